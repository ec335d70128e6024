"""The host-loss watchdog: a process whose peer stopped answering exits in order, at once.

Left to itself, JAX ends the survivors of a lost process from C++ (an abort with a stack
trace, exit status -6) after its heartbeat timeout, or they wait in a collective for the dead
peer. Instead every process of a many-process job runs two daemon threads:

- the *beat* writes a counter under ``tpu_estimator/beat/<process>`` in the coordination
  service's key-value store every ``bound / 10`` seconds (at most every second);
- the *judge* reads every process's counter and, when one has not changed for ``bound``
  seconds (or the coordination service itself stopped answering for that long: process 0
  is lost), logs ONE error naming the lost process (id, host, pid) and the last committed
  checkpoint, flushes the logs, and ends this process with :data:`HOST_LOST_EXIT_CODE`
  (``os._exit``: nothing waits for the dead peer).

A process that exits normally marks its key ``"exited"``, so its peers do not count it as
lost. An uncaught exception (a collective that failed because the peer died) waits for the
judge's verdict before its traceback is printed: about a second when every peer still beats.

The bound is ``TPUClusterResolver(heartbeat_timeout=...)`` (default 20 s); JAX's own
heartbeat timeout is set above it (:func:`jax_heartbeat_timeout`), so the watchdog speaks
first. On CPU, gloo can still abort a survivor that is mid-collective when the peer dies
("Received data size doesn't match expected size", exit -6) before the watchdog can speak.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import _compat

log = logging.getLogger("estimator")

HOST_LOST_EXIT_CODE = 75  # EX_TEMPFAIL: restart every process and the job resumes
_PREFIX = "tpu_estimator/"
_EXITED = "exited"
_state: dict[str, Any] = {}  # the running watchdog of this process (at most one)


def jax_heartbeat_timeout(bound: int) -> int:
    """JAX's own heartbeat timeout for a watchdog ``bound``: late enough that the watchdog
    reports a lost process before JAX aborts the survivors."""
    return 2 * bound + 10


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


class _Watchdog:
    def __init__(self, client: Any, *, process_id: int, num_processes: int, bound: int):
        self.client, self.me, self.bound = client, process_id, bound
        self.interval = min(1.0, bound / 10)
        start = time.monotonic()
        self.seen = {i: ("", start) for i in range(num_processes) if i != process_id}
        self.service_ok_at = start
        self.model_dir: str | None = None
        self.latest_checkpoint: Callable[[str], str | None] | None = None
        self.exiting = False
        self.lock = threading.Lock()

    def beat(self) -> None:
        count = 0
        while not self.exiting:
            count += 1
            try:
                self.client.key_value_set(f"{_PREFIX}beat/{self.me}", str(count), True)
            except Exception:  # noqa: BLE001 - the judge reports a silent service
                pass
            time.sleep(self.interval)

    def judge(self) -> None:
        while True:
            self._observe()
            with self.lock:
                if all(value == _EXITED for value, _ in self.seen.values()):
                    return  # every peer ended normally: nothing left to lose
                lost = lost_peer(
                    self.seen,
                    now=time.monotonic(),
                    bound=self.bound,
                    service_ok_at=self.service_ok_at,
                )
            if lost is not None:
                self._exit(lost)
            time.sleep(self.interval)

    def _observe(self) -> None:
        try:
            entries = self.client.key_value_dir_get(f"{_PREFIX}beat/")
        except Exception:  # noqa: BLE001 - a silent service is judged by its age
            return
        now = time.monotonic()
        with self.lock:
            self.service_ok_at = now
            for key, value in entries:
                i = int(key.rsplit("/", 1)[-1])
                if i in self.seen and self.seen[i][0] != value:
                    self.seen[i] = (value, now)

    def _describe(self, process: int) -> str:
        try:
            peer = json.loads(self.client.key_value_try_get(f"{_PREFIX}peer/{process}"))
            return f"process {process} (host {peer['host']}, pid {peer['pid']})"
        except Exception:  # noqa: BLE001 - the coordinator itself may be the one lost
            return f"process {process}"

    def _checkpoint(self) -> str:
        if self.model_dir is None or self.latest_checkpoint is None:
            return "no model_dir is known to this process"
        try:
            latest = self.latest_checkpoint(self.model_dir)
        except Exception as e:  # noqa: BLE001 - the message must still be given
            return f"could not be read from {self.model_dir} ({e})"
        return latest or f"none yet in {self.model_dir} (a restart starts from step 0)"

    def _exit(self, process: int) -> None:
        what = "the coordination service (hosted by process 0) stopped answering"
        if process != 0 or time.monotonic() - self.service_ok_at <= self.bound:
            what = "it sent no heartbeat"
        log.error(
            "Lost %s: %s for %d s (heartbeat_timeout). Last committed checkpoint: %s. "
            "Restart every process with the same command to resume from it. Process %d "
            "exits with code %d.",
            self._describe(process),
            what,
            self.bound,
            self._checkpoint(),
            self.me,
            HOST_LOST_EXIT_CODE,
        )
        for handler in [*logging.getLogger("estimator").handlers, *logging.root.handlers]:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HOST_LOST_EXIT_CODE)

    def wait_for_verdict(self) -> None:
        """Before an uncaught exception's traceback (a collective that failed because a peer
        died, say): waits until every peer has beaten since, or the judge ends this process
        with its one message. Returns at once when no peer is lost (about a second).

        A beat counts when its value differs from the one in the store now, read here: the
        judge's own copy may lag (a loaded machine), and a dead peer's last beat, seen late,
        must not pass for a new one."""
        self._observe()
        with self.lock:
            before = {i: value for i, (value, _) in self.seen.items()}
        since = time.monotonic()
        while time.monotonic() - since < self.bound + 5:  # the judge speaks within it
            with self.lock:
                if all(v == _EXITED or v != before[i] for i, (v, _) in self.seen.items()):
                    return
            time.sleep(self.interval / 2)

    def mark_exited(self) -> None:
        """At a normal exit: tell the peers, stop beating, keep judging (a process leaving
        because a peer died still waits for JAX's shutdown barrier, which the judge ends)."""
        self.exiting = True
        try:
            self.client.key_value_set(f"{_PREFIX}beat/{self.me}", _EXITED, True)
        except Exception:  # noqa: BLE001 - the peers then judge by the service's silence
            pass


def start(*, process_id: int, num_processes: int, bound: int) -> bool:
    """Starts the watchdog of this process once ``jax.distributed`` is running; a no-op for
    one process or when it already runs. Returns whether one runs now."""
    if _state:
        return True
    client = _compat.distributed_client()
    if client is None or num_processes < 2:
        return False
    dog = _Watchdog(client, process_id=process_id, num_processes=num_processes, bound=bound)
    who = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
    client.key_value_set(f"{_PREFIX}peer/{process_id}", who, True)
    for target in (dog.beat, dog.judge):
        threading.Thread(
            target=target, name=f"estimator-watchdog-{target.__name__}", daemon=True
        ).start()
    # Registered after jax.distributed's own atexit shutdown, so it runs before it.
    atexit.register(dog.mark_exited)
    sys.excepthook = _verdict_first(sys.excepthook, dog)
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
