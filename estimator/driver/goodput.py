"""Goodput: where a training job's wall time went, measured on the driver's own thread.

Every moment of a ``train`` call belongs to one part:

* ``productive``: the device loops (launching the compiled calls and waiting for them);
* ``compile``: tracing, lowering and compiling on the driver thread (JAX's own duration
  events), and waiting for a program compiled ahead on another thread;
* ``input_wait``: waiting for the next staged input (the input pipeline runs ahead on its
  own thread, so this is only the time the loop could not go on);
* ``checkpoint``: finding, restoring and writing checkpoints, and waiting for their commit;
* ``host``: everything else the host does between loops: host_call, summaries, hooks,
  evaluations of ``train_and_evaluate``, start-up;
* ``lost``: the time earlier runs of the same model_dir spent after their last checkpoint,
  redone after their restart.

The driver marks phases (``with phase("checkpoint"): ...``, ``each(iterator, "input_wait")``)
and the time between marks goes to the phase that was current, less the compile time
reported inside it, so the parts sum to the wall time by construction. Outside an active
``Goodput`` (evaluation, other threads) the marks do nothing; inside, a mark costs two clock
reads.

These marks are not the stall watchdog's (``cluster/progress.enter``), though a few sites
carry both: the watchdog's count the same sequence of calls on every process, evaluation and
prediction included (``dispatch`` marks each call), while goodput attributes time of the
``train`` call only, so an evaluation inside ``train_and_evaluate`` stays ``host`` time
rather than becoming ``productive`` or ``input_wait``. One mark feeding both would have to
carry that distinction at every site.

Across restarts the totals accumulate through ``goodput.json`` in model_dir
(``goodput_record``): the totals at each checkpoint and up to the last loop, with the step
reached, so a run restarted from a checkpoint counts the time the previous run spent after
it as lost.

Example:
  >>> gp = Goodput()
  >>> with active(gp):
  ...     with phase("productive"):
  ...         run_loops()
  >>> gp.totals()["productive_s"] <= gp.totals()["wall_s"]
  True
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax

from ..engine import ahead

log = logging.getLogger("estimator")

PARTS = ("productive", "compile", "input_wait", "checkpoint", "host", "lost")
DEFAULT = "host"
FILE = "goodput.json"
WRITE_EVERY_SECS = 30.0
# JAX's duration events of work done to build a program, on the thread that builds it.
COMPILE_EVENTS = frozenset(
    {
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
        ahead.COMPILE_WAIT,  # waiting for a program compiled on another thread
    }
)


def zero_totals() -> dict[str, float]:
    """Totals of no time: ``wall_s`` and every ``<part>_s`` at 0."""
    return {"wall_s": 0.0, **{f"{p}_s": 0.0 for p in PARTS}}


class Goodput:
    """The time of one ``train`` call by part, on top of the totals of earlier runs.

    Args:
      since: ``clock()`` when the call started (default: now).
      model_dir: where ``goodput.json`` goes (``goodput_record``); None: nowhere.
      clock: seconds, monotonic (for tests).
    """

    def __init__(
        self,
        *,
        since: float | None = None,
        model_dir: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._clock, self.model_dir = clock, model_dir
        self.started = clock() if since is None else since
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self._current, self._since = DEFAULT, self.started
        self._compiles: list[tuple[float, float]] = []  # (start, end) in the current phase
        self.owner = threading.get_ident()
        self.base = zero_totals()  # the model_dir's totals before this call
        self.base_step: int | None = None  # the step those totals end at
        self.checkpoint_step: int | None = None  # the last checkpoint
        self.checkpoints: dict[str, dict[str, float]] = {}  # step -> the totals at it
        self.last_written = self.started

    def now(self) -> float:
        return self._clock()

    # ---------------------------------------------------------------- marking
    def switch(self, name: str) -> str:
        """Makes ``name`` the current part; returns the previous one."""
        now = self._clock()
        spent = now - self._since
        compiled = min(_covered(self._compiles, self._since, now), spent)
        self._compiles.clear()
        self.seconds[self._current] += spent - compiled
        self.seconds["compile"] += compiled
        previous, self._current, self._since = self._current, name, now
        return previous

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous = self.switch(name)
        try:
            yield
        finally:
            self.switch(previous)

    def compiled(self, seconds: float) -> None:
        """A compile of ``seconds`` that just ended on the owner thread."""
        now = self._clock()
        self._compiles.append((now - seconds, now))

    # ---------------------------------------------------------------- reading
    def call_totals(self) -> dict[str, float]:
        """This call's seconds by part (``<part>_s``) and ``wall_s``, up to now."""
        self.switch(self._current)
        out = {f"{p}_s": self.seconds[p] for p in PARTS}
        out["wall_s"] = self._since - self.started  # the same instant the parts end at
        return out

    def totals(self) -> dict[str, float]:
        """The model_dir's totals (earlier runs and this call) with ``fraction``, the
        productive share of the wall time."""
        now = self.call_totals()
        out = {k: self.base.get(k, 0.0) + now[k] for k in now}
        out["fraction"] = out["productive_s"] / out["wall_s"] if out["wall_s"] > 0 else 0.0
        return out


def _covered(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` inside the union of ``spans`` (nested compiles count once)."""
    total, reach = 0.0, lo
    for start, end in sorted(spans):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


# -------------------------------------------------------------------- the active one
_ACTIVE: list[Goodput] = []
_INSTALLED: list[bool] = []


def current() -> Goodput | None:
    """The active accumulator (the innermost ``active``), if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def _on_duration(event: str, duration: float, **_: Any) -> None:
    if event in COMPILE_EVENTS and _ACTIVE and _ACTIVE[-1].owner == threading.get_ident():
        _ACTIVE[-1].compiled(duration)


@contextlib.contextmanager
def active(gp: Goodput) -> Iterator[Goodput]:
    """Makes ``gp`` the accumulator the marks of its thread feed."""
    if not _INSTALLED:  # once per process; JAX keeps its listeners for good
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _INSTALLED.append(True)
    _ACTIVE.append(gp)
    try:
        yield gp
    finally:
        _ACTIVE.remove(gp)


def phase(name: str) -> contextlib.AbstractContextManager:
    """``with phase("checkpoint"): ...``: the time inside goes to that part (a no-op outside
    an active ``Goodput`` or on another thread)."""
    gp = _ACTIVE[-1] if _ACTIVE else None
    if gp is None or gp.owner != threading.get_ident():
        return contextlib.nullcontext()
    return gp.phase(name)


def each(items: Iterable, name: str) -> Iterable:
    """``items``, each read counted as part ``name`` (``items`` itself when inactive)."""
    gp = _ACTIVE[-1] if _ACTIVE else None
    if gp is None or gp.owner != threading.get_ident():
        return items
    return _each(iter(items), gp, name)


def _each(it: Iterator, gp: Goodput, name: str) -> Iterator:
    while True:
        with gp.phase(name):
            box = [next(it, _END)]
        if box[0] is _END:
            return
        yield box.pop()  # from a list: this frame keeps no reference to the item


_END = object()


__all__ = [
    "FILE",
    "PARTS",
    "Goodput",
    "active",
    "current",
    "each",
    "phase",
    "zero_totals",
]
