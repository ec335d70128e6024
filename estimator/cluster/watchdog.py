"""The job watchdog: a process whose peer died, or is stuck, exits in order within a bound.

Left to itself, JAX ends the survivors of a lost process from C++ (an abort with a stack
trace, exit status -6) after its heartbeat timeout, or they wait in a collective for the dead
peer; and a peer that is alive but stuck (its main thread blocked in ``input_fn``, a hung
read, a deadlock) holds every other process in a collective for ever. Instead every process
of a many-process job runs three daemon threads, none of which needs the main thread:

- the *beat* writes a record under ``tpu_estimator/beat/<process>`` in the coordination
  service's key-value store every ``interval`` seconds (a tenth of the shortest bound, at
  most one second): a counter, which proves the process alive, and what its main thread is
  doing: phase, step, progress, whether it waits in a collective (``progress.py``);
- the *reader* reads every process's record (and a verdict another process published);
- the *judge* decides from what was read, never waiting on the service itself:

  * **lost**: a process whose counter has not changed for ``heartbeat_timeout`` seconds, or
    process 0 when the coordination service it hosts stopped answering for that long;
  * **stuck**: the rule of ``progress.py``: no process moved for ``stall_timeout`` seconds
    while some wait in a collective; named is the one not waiting with the least progress.

  It logs ONE error naming the process (id, host, pid), what it was doing and the last
  committed checkpoint, publishes the verdict so every process gives the same one, and ends
  this process with :data:`HOST_LOST_EXIT_CODE` (``os._exit``: nothing waits for the
  peer). Process 0 leaves last (at most ``_LINGER`` seconds), as the others read the
  verdict from the service it hosts.

**Process 0 lost.** When process 0 dies while its machine stays up, its sockets close at
once and JAX's agent in every other process aborts within milliseconds ("Terminating process
because the JAX distributed service detected fatal errors", SIGABRT) - long before any
heartbeat bound. JAX 0.10 offers no hook that can stop it from Python (its client's
``missed_heartbeat_callback`` cannot be given a Python function: the call aborts with
``std::bad_cast``), so the watchdog catches SIGABRT (``_AbortGuard``): when the coordinator's
port no longer accepts connections (or a verdict is known), the abort becomes the same
exit 75 naming process 0; any other abort goes on as before. JAX's C++ lines (the fatal line
and its stack) still come first in the log.

A process that exits normally marks its key ``"exited"``, so its peers do not count it as
lost. An uncaught exception (a collective that failed because the peer died) waits for the
judge's verdict before its traceback is printed: about a second when every peer still beats.
JAX's own heartbeat timeout is set above ``heartbeat_timeout`` (:func:`jax_heartbeat_timeout`)
so the watchdog speaks first. On CPU, gloo can still abort a survivor that is mid-collective
when a peer other than process 0 dies ("Received data size doesn't match expected size").

Example:
  >>> start(process_id=jax.process_index(), num_processes=jax.process_count(), bound=20)
  >>> watch_model_dir("/runs/a", step_names.newest_finished_path)
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..core import _compat
from ..core.errors import EstimatorValueError
from . import progress
from .progress import DEFAULT_STALL_TIMEOUT, STALL_TIMEOUT_ENV

__all__ = ["DEFAULT_STALL_TIMEOUT", "HOST_LOST_EXIT_CODE", "STALL_TIMEOUT_ENV"]

log = logging.getLogger("estimator")

HOST_LOST_EXIT_CODE = 75  # EX_TEMPFAIL: restart every process and the job resumes
_PREFIX = "tpu_estimator/"
_EXITED = "exited"
_LINGER = 10.0  # seconds process 0 (the service's host) waits for the others to leave
_SERVICE_CALL = 5.0  # seconds an exiting process waits for one key-value call
_CHECKPOINT_READ = 15.0  # seconds to name the last checkpoint (a hung disk may be the cause)
_RESTART = "Restart every process with the same command to resume from it."
_state: dict[str, Any] = {}  # the running watchdog of this process (at most one)


def jax_heartbeat_timeout(bound: float) -> int:
    """JAX's own heartbeat timeout for a watchdog ``bound``: late enough that the watchdog
    reports a lost process before JAX aborts the survivors."""
    return math.ceil(2 * bound + 10)


def timeout_seconds(name: str, value: Any, *, env: str, default: float) -> float:
    """A timeout in seconds: ``value``, else the environment variable ``env``, else
    ``default``; an int or a float, positive and finite.

    Raises:
      EstimatorValueError: not a positive number of seconds (the message names ``name``,
        and ``env`` when the value came from it).

    Example:
      >>> timeout_seconds("stall_timeout", None, env=STALL_TIMEOUT_ENV, default=1800)
      1800.0
    """
    source = name
    if value is None and os.environ.get(env, "").strip():
        value, source = os.environ[env].strip(), f"{name} (from {env})"
        try:
            value = float(value)
        except ValueError:
            pass
    if value is None:
        value = default
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise EstimatorValueError(
            f"{source} must be a positive number of seconds (an int or a float), got {value!r}"
        )
    return float(value)


def lost_peer(
    seen: dict[int, tuple[str, float]], *, now: float, bound: float, service_ok_at: float
) -> int | None:
    """The process the judge gives up on, or None.

    Args:
      seen: per process id, its last counter value and when (``time.monotonic()``) this
        process saw it change; ``"exited"`` marks a process that ended normally.
      now: the current ``time.monotonic()``.
      bound: seconds without a change after which a process is lost.
      service_ok_at: when the coordination service last answered; silent for ``bound``
        seconds means process 0 (which hosts it) is lost.
    """
    if now - service_ok_at > bound:
        return 0
    stale = [i for i, (value, at) in seen.items() if value != _EXITED and now - at > bound]
    return min(stale) if stale else None


class _Peer:
    """What this process last read of one process (itself included)."""

    def __init__(self, start: float):
        self.value, self.beat_at = "", start  # the raw heartbeat, and when it changed
        self.record: progress.Record | None = None
        self.moved_at = start  # when its (progress, waiting) changed
        self.gone = False  # it left through the watchdog


class _Watchdog:
    def __init__(self, client: Any, *, process_id: int, num_processes: int, bound, stall):
        self.client, self.me, self.bound, self.stall = client, process_id, bound, stall
        self.interval = min(1.0, bound / 10, stall / 10)
        self.fresh = 3 * self.interval + 2  # a heartbeat older than this is late
        start = time.monotonic()
        self.procs = {i: _Peer(start) for i in range(num_processes)}
        self.service_ok_at = start
        self.hosts: dict[int, str] = {}  # "host h, pid p" per process, read once
        self.published: str | None = None  # a verdict another process published
        self.verdict: str | None = None  # this process's, once given
        self.model_dir: str | None = None
        self.latest_checkpoint: Callable[[str], str | None] | None = None
        self.exiting = False
        self.stopped = threading.Event()  # set once JAX's client is shut down at exit
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.exit_lock = threading.Lock()

    # ------------------------------------------------------------------ the threads
    def beat(self) -> None:
        count = 0
        while not self.exiting:
            count += 1
            try:
                value = progress.snapshot().to_json(count)
                self.client.key_value_set(f"{_PREFIX}beat/{self.me}", value, True)
            except Exception:  # noqa: BLE001 - the judge reports a silent service
                pass
            time.sleep(self.interval)

    def read(self) -> None:
        while not self.stopped.is_set():
            self._observe()
            self.stopped.wait(self.interval)

    def judge(self) -> None:
        while not self.stopped.is_set():
            with self.lock:
                others = [p for i, p in self.procs.items() if i != self.me]
                if all(p.value == _EXITED for p in others) and self.published is None:
                    return  # every peer ended normally: nothing left to lose
            verdict = self._verdict()
            if verdict is not None and not self.stopped.is_set():
                self._conclude(verdict, tell=time.monotonic() - self.service_ok_at < self.bound)
            self.stopped.wait(self.interval)

    def _observe(self) -> None:
        try:
            entries = self.client.key_value_dir_get(_PREFIX)
        except Exception:  # noqa: BLE001 - a silent service is judged by its age
            return
        now = time.monotonic()
        with self.lock:
            self.service_ok_at = now
            for key, value in entries:
                self._take(key[len(_PREFIX) :], value, now)

    def _take(self, key: str, value: str, now: float) -> None:
        kind, _, index = key.partition("/")
        if kind == "verdict":
            self.published = value
            return
        if not index.isdigit() or int(index) not in self.procs:
            return
        i = int(index)
        peer = self.procs[i]
        if kind == "peer" and i not in self.hosts:
            try:
                info = json.loads(value)
                self.hosts[i] = f"host {info['host']}, pid {info['pid']}"
            except (ValueError, TypeError, KeyError):
                self.hosts[i] = ""
        elif kind == "gone":
            peer.gone = True
        elif kind == "beat" and value != peer.value:
            record = progress.Record.from_json(value)
            old = peer.record
            if record is None or old is None or record[2:4] != old[2:4]:
                peer.moved_at = now  # (progress, waiting) changed
            peer.value, peer.beat_at, peer.record = value, now, record

    # ------------------------------------------------------------------ the verdict
    def _verdict(self) -> str | None:
        """The message body this process exits with, or None (it goes on)."""
        now = time.monotonic()
        with self.lock:
            if self.published is not None:
                return self.published
            seen = {i: (p.value, p.beat_at) for i, p in self.procs.items() if i != self.me}
            lost = lost_peer(seen, now=now, bound=self.bound, service_ok_at=self.service_ok_at)
            stuck, record = None, None
            if lost is None:
                stuck = progress.stuck_process(
                    self._participants(), now=now, bound=self.stall, fresh=self.fresh
                )
                record = None if stuck is None else self.procs[stuck].record
        if lost is not None:
            silent = lost == 0 and now - self.service_ok_at > self.bound
            what = "it sent no heartbeat"
            if silent:
                what = "the coordination service (hosted by process 0) stopped answering"
            return self._lost(lost, f"{what} for {self.bound:g} s (heartbeat_timeout)")
        if stuck is None:
            return None
        doing = f"its main thread at {record.where or 'an unknown place'}"
        if record.waiting:
            doing = "waiting in a collective the others have passed"
        return (
            f"P{self._name(stuck)[1:]} is stuck: no progress for "
            f"{self.stall:g} s (stall_timeout) in phase {record.phase!r} after step "
            f"{record.step}, {doing}, while the other processes wait for it. "
            f"Last committed checkpoint: {self._checkpoint()}. {_RESTART}"
        )

    def _participants(self) -> dict[int, progress.Seen]:
        return {
            i: progress.Seen(p.record, p.moved_at, p.beat_at)
            for i, p in self.procs.items()
            if p.record is not None and p.value != _EXITED and not p.gone
        }

    def _lost(self, process: int, what: str) -> str:
        return (
            f"Lost {self._name(process)}: {what}. "
            f"Last committed checkpoint: {self._checkpoint()}. {_RESTART}"
        )

    def _name(self, process: int) -> str:
        host = self.hosts.get(process)
        return f"process {process} ({host})" if host else f"process {process}"

    def _checkpoint(self) -> str:
        if self.model_dir is None or self.latest_checkpoint is None:
            return "no model_dir is known to this process"
        found: list = []

        def read() -> None:
            try:
                found.append(self.latest_checkpoint(self.model_dir) or "")
            except Exception as e:  # noqa: BLE001 - the message must still be given
                found.append(e)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + _CHECKPOINT_READ
        while not found and time.monotonic() < deadline:
            time.sleep(0.05)
        if not found:
            return f"could not be read from {self.model_dir} in {_CHECKPOINT_READ:g} s"
        if isinstance(found[0], Exception):
            return f"could not be read from {self.model_dir} ({found[0]})"
        return found[0] or f"none yet in {self.model_dir} (a restart starts from step 0)"

    def _conclude(self, body: str, *, tell: bool) -> None:
        """Logs ``body`` once, tells the others (``tell``: the service still answers), and
        ends this process with code 75."""
        if not self.exit_lock.acquire(blocking=False):
            while True:  # another thread is ending the process
                time.sleep(1)
        self.verdict = body
        log.error("%s Process %d exits with code %d.", body, self.me, HOST_LOST_EXIT_CODE)
        for handler in [*logging.getLogger("estimator").handlers, *logging.root.handlers]:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        if tell and self.published is None:
            _within(_SERVICE_CALL, self.client.key_value_set, f"{_PREFIX}verdict", body, True)
        if tell and self.me == 0:
            self._linger()
        elif tell:
            _within(_SERVICE_CALL, self.client.key_value_set, f"{_PREFIX}gone/{self.me}", "75")
        os._exit(HOST_LOST_EXIT_CODE)

    def _linger(self) -> None:
        """Process 0 hosts the service the others read the verdict from: it waits (at
        most ``_LINGER`` seconds) until every live peer has left."""
        deadline = time.monotonic() + _LINGER
        while time.monotonic() < deadline:
            self._observe()
            now = time.monotonic()
            with self.lock:
                if all(
                    p.gone or p.value == _EXITED or now - p.beat_at > self.fresh
                    for i, p in self.procs.items()
                    if i != self.me
                ):
                    return
            time.sleep(self.interval / 2)

    # ------------------------------------------------------------------ other entries
    def on_abort(self, signum: int) -> bool:
        """SIGABRT (JAX's runtime ending this process): exits 75 when a verdict is known or
        the coordination service is gone; False lets the abort go on."""
        if self.verdict is None and self.published is None and _service_answers():
            return False
        if self.verdict is None and self.published is None:
            what = "the coordination service it hosts closed its connections"
            if self.procs[0].value == _EXITED:
                what = "it ended its run and shut down the coordination service it hosts"
            body = self._lost(0, f"{what} (JAX's runtime was aborting this process)")
            self._conclude(body, tell=False)
        self._conclude(self.verdict or self.published, tell=False)
        return True

    def wait_for_verdict(self) -> None:
        """Before an uncaught exception's traceback (a collective that failed because a peer
        died, say): waits until every peer has beaten since, or the judge ends this process
        with its one message. Returns at once when no peer is lost (about a second).

        A beat counts when its value differs from the one in the store now, read here: the
        judge's own copy may lag (a loaded machine), and a dead peer's last beat, seen late,
        must not pass for a new one."""
        self._observe()
        with self.lock:
            before = {i: p.value for i, p in self.procs.items() if i != self.me}
        since = time.monotonic()
        while time.monotonic() - since < self.bound + 5:  # the judge speaks within it
            with self.lock:
                values = {i: self.procs[i].value for i in before}
            if all(v == _EXITED or v != before[i] for i, v in values.items()):
                return
            time.sleep(self.interval / 2)

    def mark_exited(self) -> None:
        """At a normal exit: tell the peers, stop beating, shut JAX's client down while the
        judge still runs (a process leaving because a peer died waits in that shutdown's
        barrier, which the judge ends), then stop the watchdog's threads.

        The threads must not outlive this: the interpreter ends daemon threads that are
        still running when it finalizes, and one ended inside a call into JAX's client
        aborted the process after its work was done ("FATAL: exception not rethrown",
        exit status -6), which a scheduler reads as a failed job."""
        self.exiting = True
        try:
            self.client.key_value_set(f"{_PREFIX}beat/{self.me}", _EXITED, True)
        except Exception:  # noqa: BLE001 - the peers then judge by the service's silence
            pass
        import jax  # loaded long before: this process joined a job through it

        try:
            jax.distributed.shutdown()  # JAX's own atexit call then finds nothing to do
        finally:
            self.stopped.set()
            for thread in self.threads:
                thread.join(timeout=_SERVICE_CALL)


def _within(seconds: float, fn: Callable, *args) -> None:
    """Calls ``fn(*args)`` on a helper thread, waiting at most ``seconds`` (a call to a
    service that stopped answering must not keep this process from exiting)."""
    done = threading.Event()

    def call() -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - best effort: the process is leaving
            pass
        done.set()

    threading.Thread(target=call, daemon=True).start()
    done.wait(seconds)


def _service_answers() -> bool:
    """Whether the coordinator's port still accepts a connection (True when unknown)."""
    try:
        from jax._src import distributed  # private: JAX exposes no coordinator address

        address = distributed.global_state.coordinator_address
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except (ImportError, AttributeError, ValueError):
        return True
    except OSError:
        return False


class _AbortGuard:
    """A C-level SIGABRT handler (through ctypes) that hands the abort to the watchdog.

    A Python ``signal.signal`` handler cannot do it: it only runs after the C handler
    returns, and abort() then ends the process. The handler runs on the aborting thread,
    which takes the GIL like any thread calling into Python. An abort the watchdog does not
    take is passed to the handler installed before (faulthandler's, say), then goes on.
    """

    _TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int)

    def __init__(self, dog: _Watchdog):
        self.dog = dog
        self.handler = self._TYPE(self._on_abort)  # referenced here: must outlive the call
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        self.previous = libc.signal(signal.SIGABRT, ctypes.cast(self.handler, ctypes.c_void_p))

    def _on_abort(self, signum: int) -> None:
        try:
            if self.dog.on_abort(signum):
                return
        except BaseException:  # noqa: BLE001 - never raise into C
            pass
        if self.previous not in (None, 0, 1, ctypes.c_void_p(-1).value):  # SIG_DFL/IGN/ERR
            self._TYPE(self.previous)(signum)


def start(
    *, process_id: int, num_processes: int, bound: float, stall_timeout: float | None = None
) -> bool:
    """Starts the watchdog of this process once ``jax.distributed`` is running; a no-op for
    one process or when it already runs. Returns whether one runs now.

    Args:
      process_id: this process.
      num_processes: processes in the job.
      bound: ``heartbeat_timeout``, seconds without a heartbeat before a process is lost.
      stall_timeout: seconds without progress before a process is stuck (see
        ``progress.py``); None reads ``TPU_ESTIMATOR_STALL_TIMEOUT``, else 1800 (30
        minutes, above the largest legitimate compile; a compile is given at least that
        whatever the bound).
    """
    if _state:
        return True
    client = _compat.distributed_client()
    if client is None or num_processes < 2:
        return False
    stall = timeout_seconds(
        "stall_timeout", stall_timeout, env=STALL_TIMEOUT_ENV, default=DEFAULT_STALL_TIMEOUT
    )
    dog = _Watchdog(
        client, process_id=process_id, num_processes=num_processes, bound=bound, stall=stall
    )
    who = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
    client.key_value_set(f"{_PREFIX}peer/{process_id}", who, True)
    progress.activate()
    for target in (dog.beat, dog.read, dog.judge):
        thread = threading.Thread(
            target=target, name=f"estimator-watchdog-{target.__name__}", daemon=True
        )
        thread.start()
        dog.threads.append(thread)
    # Registered after jax.distributed's own atexit shutdown, so it runs before it.
    atexit.register(dog.mark_exited)
    sys.excepthook = _verdict_first(sys.excepthook, dog)
    try:
        _state["abort_guard"] = _AbortGuard(dog)
    except (OSError, AttributeError) as e:  # no C library to install it through
        log.debug("SIGABRT guard not installed: %s", e)
    _state["dog"] = dog
    return True


def _verdict_first(hook: Callable, dog: _Watchdog) -> Callable:
    def excepthook(kind, value, tb) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            dog.wait_for_verdict()
        hook(kind, value, tb)

    return excepthook


def watch_model_dir(model_dir: str | None, latest_checkpoint: Callable[[str], str | None]) -> None:
    """Names ``latest_checkpoint(model_dir)`` in the host-loss message (the last estimator
    built in this process wins)."""
    dog = _state.get("dog")
    if dog is not None and model_dir is not None:
        dog.model_dir, dog.latest_checkpoint = model_dir, latest_checkpoint
