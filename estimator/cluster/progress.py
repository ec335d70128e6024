"""What each process of a many-process job is doing, and which one holds the others up.

The driver marks where its main thread is with ``enter(phase, step)``; ``each`` marks the
reads of an iterator. Both are a no-op until the watchdog runs (a one-process job), and
then cost one attribute store: no lock, no communication. Every heartbeat of the watchdog
(``watchdog.py``) publishes a ``Record`` taken by ``snapshot()``:

- ``phase``: the last one entered (``"startup"``, ``"input"``, ``"step"``, ``"hooks"``,
  ``"host_call"``, ``"checkpoint"``), or ``"compile"`` while the main thread traces,
  lowers or compiles a program (JAX's tracer, its MLIR lowering, XLA's compiler);
- ``step``: the global step reached;
- ``progress``: how many phases this process has entered. Every call site is on a path all
  processes run alike, so equal counters mean the same point of the program;
- ``waiting``: whether the main thread is blocked in a cross-process operation (JAX's
  ``multihost_utils``, ``estimator.parallel.multihost``, Orbax's barriers), read from its
  stack: the innermost frame outside the standard library and JAX's and numpy's internals
  is one of those;
- ``where``: the innermost frame of the main thread outside the libraries, for the message.

The stall rule (``stuck_process``), which every process's judge applies to the records of
all, so that all name the same process:

1. The participants are the processes that publish a record, beat, and have not exited;
   fewer than two are never judged, and no judgement is made while a participant's
   heartbeat is late (a silent process is the liveness judge's: it is *lost*, not stuck).
2. A participant *moves* when its progress counter or its waiting flag changes. The job is
   stalled when no participant has moved for the stall bound (one in ``"compile"`` is given
   at least ``COMPILE_FLOOR``: a compile ends, and the largest take many minutes) and at
   least one participant waits in a collective. Processes busy on their own (user code
   between estimator calls, or all blocked on one shared disk) are not judged: nobody waits
   for anybody.
3. The stuck process is the participant *not* waiting with the lowest progress (then the
   lowest id): the ones waiting in a collective are held up by it, not stuck themselves.
   When every participant waits (a collective that never completes, or processes in
   different ones), the one with the lowest progress is behind the others and is named.

The judge threads decide, not the main threads: the waiting processes' main threads are as
blocked as the stuck one's.

Example:
  >>> for batch in each(batches, "input", then="step", step=lambda: run.step):
  ...     run_the_step(batch)                     # published as phase "step"
  >>> enter("checkpoint", run.step)
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

STALL_TIMEOUT_ENV = "TPU_ESTIMATOR_STALL_TIMEOUT"
DEFAULT_STALL_TIMEOUT = 1800.0  # 30 minutes: above the largest legitimate compile
COMPILE_FLOOR = DEFAULT_STALL_TIMEOUT  # a compile is never cut shorter, whatever the bound
COMPILE = "compile"

# Path fragments (with "/" as the separator) that classify a frame of the main thread.
_INTERNALS = ("/jax/_src/", "/jaxlib/", "/numpy/")  # how a wait is implemented, not why
_STDLIB = sysconfig.get_paths()["stdlib"].replace(os.sep, "/") + "/"
_INSTALLED = ("/site-packages/", "/dist-packages/")
_COLLECTIVES = (
    "/jax/experimental/multihost_utils.py",
    "/estimator/parallel/multihost.py",
    "/orbax/checkpoint/_src/multihost/",
)
# Tracing to a jaxpr, lowering to MLIR, compiling: the phase "compile".
_COMPILING = (
    "/jax/_src/interpreters/partial_eval.py",
    "/jax/_src/interpreters/mlir.py",
    "/jax/_src/compiler.py",
)
_OURS = "/estimator/"
_WHERE_CHARS = 120  # keeps a record small: every process reads every record each second


class _Position(NamedTuple):
    phase: str
    step: int
    progress: int
    thread: int | None  # the thread that entered it (the driver's: usually the main one)


_position = _Position("startup", 0, 0, threading.main_thread().ident)
_active = False


def activate() -> None:
    """Starts recording phases (the watchdog calls it when a many-process job starts)."""
    global _active
    _active = True


def enter(phase: str, step: int | None = None) -> None:
    """Marks that this thread now runs ``phase`` (at global ``step``; None keeps the last).

    Every process must make the same calls in the same order (as for a collective, though
    nothing is sent): the counter they advance is compared across processes.
    """
    global _position
    if not _active:
        return
    p = _position
    step = p.step if step is None else int(step)
    _position = _Position(phase, step, p.progress + 1, threading.get_ident())


def each(
    items: Iterable,
    phase: str,
    *,
    then: str | None = None,
    step: Callable[[], int] | None = None,
) -> Iterable:
    """``items``, with ``phase`` entered before each read and ``then`` after it (also after
    the last, failed read: what follows is the caller's own work). ``step()`` gives the step
    to publish. ``items`` itself while no watchdog runs.

    Example:
      >>> for chunk in each(calls, "input", then="step"):
      ...     launch(chunk)
    """
    if not _active:
        return items
    return _each(iter(items), phase, then, step)


def _each(it: Iterator, phase: str, then: str | None, step) -> Iterator:
    while True:
        enter(phase, None if step is None else step())
        try:
            box = [next(it)]
        except StopIteration:
            if then is not None:
                enter(then)
            return
        if then is not None:
            enter(then)
        # Yielded from a list, so this frame keeps no reference to the item (a chunk's
        # device input is freed as soon as its caller lets go of it).
        yield box.pop()


class Record(NamedTuple):
    """What one process was doing when it last beat (see the module docstring)."""

    phase: str
    step: int
    progress: int
    waiting: bool
    where: str = ""

    def to_json(self, beat: int) -> str:
        """The heartbeat value: this record and the beat counter (which makes each new)."""
        return json.dumps({"n": beat, **self._asdict()}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Record | None:
        """The record in a heartbeat value; None for one without (``"exited"``, a bare
        counter from a process that does not publish progress)."""
        try:
            d = json.loads(text)
            fields = (d["phase"], int(d["step"]), int(d["progress"]), bool(d["waiting"]))
            return cls(*fields, str(d.get("where", "")))
        except (ValueError, TypeError, KeyError):
            return None


def snapshot() -> Record:
    """This process's record now: the phase entered, refined by the main thread's stack."""
    pos = _position
    frame = sys._current_frames().get(pos.thread)
    try:
        phase, waiting, where = read_stack(frame, pos.phase)
    finally:
        del frame  # frames hold their locals: no reference may outlive the sample
    return Record(phase, pos.step, pos.progress, waiting, where)


def read_stack(frame: Any, phase: str) -> tuple[str, bool, str]:
    """``(phase, waiting, where)`` for a thread whose innermost frame is ``frame``.

    ``phase`` becomes ``"compile"`` while any frame traces, lowers or compiles a program;
    ``waiting`` is whether the innermost frame outside the standard library and JAX's and
    numpy's internals is a cross-process operation; ``where`` is the innermost frame outside
    the libraries (estimator's or the user's code), as ``path:line in function``.
    """
    waiting, decided, where, innermost = False, False, "", ""
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if any(name.endswith(part) for part in _COMPILING):
            phase = COMPILE
        stdlib = _is_stdlib(name)
        if not decided and not stdlib and not any(part in name for part in _INTERNALS):
            waiting, decided = any(part in name for part in _COLLECTIVES), True
        if not innermost:
            innermost = _describe(frame, name)
        installed = any(part in name for part in _INSTALLED)
        if not where and (_OURS in name or not (stdlib or installed)):
            where = _describe(frame, name)
        frame = frame.f_back
    return phase, waiting, (where or innermost)[-_WHERE_CHARS:]


def _is_stdlib(name: str) -> bool:
    if name.startswith("<frozen "):  # "<frozen runpy>" (not "<string>": a user's code)
        return True
    return name.startswith(_STDLIB) and not any(part in name for part in _INSTALLED)


def _describe(frame: Any, name: str) -> str:
    short = "/".join(name.split("/")[-3:])
    return f"{short}:{frame.f_lineno} in {frame.f_code.co_name}"


class Seen(NamedTuple):
    """What a judge knows of one participant: its record, and when (its own
    ``time.monotonic()``) the record last moved and its heartbeat last changed."""

    record: Record
    moved_at: float
    beat_at: float


def stuck_process(
    seen: Mapping[int, Seen], *, now: float, bound: float, fresh: float
) -> int | None:
    """The process that holds the job up, or None (the rule is the module docstring's).

    Args:
      seen: per participant (a process that publishes records and has not exited).
      now: the judge's ``time.monotonic()``.
      bound: the stall timeout in seconds.
      fresh: seconds within which every participant's heartbeat must have changed.

    Example:
      >>> rec = lambda progress, waiting: Record("input", 6, progress, waiting)
      >>> stuck_process({0: Seen(rec(9, True), 0.0, 99.0), 1: Seen(rec(9, False), 0.0, 99.0)},
      ...               now=100.0, bound=60.0, fresh=5.0)
      1
    """
    if len(seen) < 2 or any(now - s.beat_at > fresh for s in seen.values()):
        return None
    for s in seen.values():
        allowed = max(bound, COMPILE_FLOOR) if s.record.phase == COMPILE else bound
        if now - s.moved_at <= allowed:
            return None
    if not any(s.record.waiting for s in seen.values()):
        return None
    free = [i for i, s in seen.items() if not s.record.waiting] or list(seen)
    return min(free, key=lambda i: (seen[i].record.progress, i))
