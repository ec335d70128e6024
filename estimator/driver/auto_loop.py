"""``TPUConfig(iterations_per_loop="auto")``: the loop length chosen from measurements.

A loop of ``n`` steps costs the devices ``n`` step times plus the host's fixed work between
loops (fetching the loop's outputs, hooks, summaries, the next launch), during which the
devices wait. "auto" measures both on the first loops of the first ``train`` call and picks
the smallest ``n`` whose fixed work is at most ``TARGET_OVERHEAD`` (2%) of the loop:

1. ``RunConfig`` bounds the loop (``config.auto_loop_bound``): the greatest common divisor
   of ``save_checkpoints_steps``, ``log_step_count_steps`` and ``save_summary_steps`` (those
   set), at most ``config.AUTO_LOOP_MAX``, so no loop skips past one of those steps. The
   first loops run at that bound.
2. ``LoopTuner`` (the first hook) stamps each loop's start and end: the time from one
   loop's end to the next one's start is the host's fixed work (the smallest of the first
   two gaps, so a one-off at start-up does not count), and the second loop's time over its
   steps is the step time (the first compiles). In a job of several processes, process 0's
   measurements decide for all, so every process stages the same loops.
3. The choice is made as the third loop starts; the loops staged after it (the input runs
   a loop or two ahead) have the chosen length: a divisor of the bound, and either
   at most the staging budget's call length (one compiled call per loop) or a multiple of it
   (whole calls): so no tail call is added. A length below the first call's length
   compiles one more train program, once.

The choice is made once per estimator (the first ``train`` call that runs three loops) and
kept for its later calls; evaluation and prediction use the bound. It appears in the
start-up line, which waits for it. Changing the loop length of a compiled program would
need a program per length tried, so the first loops measure at the bound and the choice
holds from then on; it is not revised as the run goes on.

Example:
  >>> candidates(100, call_steps=25)
  [1, 2, 4, 5, 10, 20, 25, 50, 100]
  >>> choose([1, 2, 4, 5, 10, 20, 25, 50, 100], gap_s=0.002, step_s=0.008)
  20
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from hooks import SessionRunContext, SessionRunHook, SessionRunValues

from ..parallel import multihost

log = logging.getLogger("estimator")

TARGET_OVERHEAD = 0.02  # the host's fixed work per loop, as a share of the loop's time
CHOSEN = "iterations_per_loop"  # the key of the choice in ``Job.loop_choice``


def candidates(bound: int, *, call_steps: int) -> list[int]:
    """The loop lengths "auto" may pick: divisors of ``bound`` that are at most
    ``call_steps`` or a multiple of it, and ``bound`` itself (the loops it started with)."""
    k = max(1, call_steps)
    fits = [n for n in range(1, bound) if bound % n == 0 and (n <= k or n % k == 0)]
    return [*fits, bound]


def choose(lengths: list[int], *, gap_s: float, step_s: float) -> int:
    """The smallest length whose fixed work ``gap_s`` is at most ``TARGET_OVERHEAD`` of the
    loop (``gap_s + n * step_s``); the largest when none is."""
    for n in sorted(lengths):
        if gap_s <= TARGET_OVERHEAD * (gap_s + n * step_s):
            return n
    return max(lengths)


def chosen(job: Any) -> int:
    """The loop length ``train`` runs: the choice "auto" made for this estimator, else the
    configured one (the bound, while "auto" has not chosen yet)."""
    return job.loop_choice.get(CHOSEN, job.config.tpu_config.iterations_per_loop)


def tuner_for(job: Any, budget: Any, *, call_steps: int) -> LoopTuner | None:
    """The tuner of a ``train`` call: only while "auto" has not chosen for ``job`` yet."""
    tpu = job.config.tpu_config
    if not tpu.auto_iterations_per_loop or CHOSEN in job.loop_choice:
        return None
    return LoopTuner(
        bound=tpu.iterations_per_loop,
        call_steps=call_steps,
        apply=budget.set_iterations_per_loop,
        remember=job.loop_choice,
    )


def note(job: Any, tuner: LoopTuner | None) -> Callable[[], str | None] | None:
    """() -> the loop length for the start-up line once known; None without "auto"."""
    if tuner is not None:
        return lambda: tuner.note
    if job.config.tpu_config.auto_iterations_per_loop:
        n = chosen(job)
        return lambda: f"auto: {n} (chosen by an earlier train call)"
    return None


def as_list(tuner: LoopTuner | None) -> list:
    return [] if tuner is None else [tuner]


class LoopTuner(SessionRunHook):
    """Measures the first loops and sets the loop length (see the module docstring).

    Args:
      bound: the configured (largest) loop length.
      call_steps: the steps of the first compiled call (the staging budget's call length).
      apply: called with the chosen length once (sets the step budget's loop length).
      remember: where the choice is kept for the estimator's later calls.
      clock: seconds, monotonic (for tests).
    """

    def __init__(
        self,
        *,
        bound: int,
        call_steps: int,
        apply: Callable[[int], None],
        remember: dict,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._bound, self._call_steps = bound, call_steps
        self._apply, self._remember, self._clock = apply, remember, clock
        self._loops = 0
        self._start = self._end = None
        self._gaps: list[float] = []
        self._step_s: float | None = None
        self.note: str | None = None  # the choice, for the start-up line

    def before_run(self, run_context: SessionRunContext) -> None:
        now = self._clock()
        if self._end is not None and self.note is None:
            self._gaps.append(now - self._end)
            if len(self._gaps) >= 2 and self._step_s is not None:
                self._decide()
        self._start = now

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        now = self._clock()
        self._loops += 1
        steps = len(run_context.steps)
        if self._loops == 2 and steps:  # the first loop compiles
            self._step_s = (now - self._start) / steps
        self._end = now

    def end(self, session: Any) -> None:
        if self.note is None:
            self.note = f"auto: {self._bound} (the bound; fewer than three loops ran to measure)"

    def _decide(self) -> None:
        gap, step = min(self._gaps), self._step_s
        lengths = candidates(self._bound, call_steps=self._call_steps)
        # Every process stages the same loops: process 0's measurements decide for all.
        gap, step = multihost.broadcast_object((gap, step))
        n = choose(lengths, gap_s=gap, step_s=step)
        self._remember[CHOSEN] = n
        self._apply(n)
        share = gap / (gap + n * step) if gap + n * step > 0 else 0.0
        self.note = (
            f"auto: {n} (measured {1e3 * gap:.3g} ms of host work per loop and "
            f"{1e3 * step:.3g} ms per step: {100 * share:.2g}% overhead at {n}; bound "
            f"{self._bound}, calls of {self._call_steps} steps)"
        )
        log.debug("iterations_per_loop %s", self.note)


__all__ = [
    "CHOSEN",
    "TARGET_OVERHEAD",
    "LoopTuner",
    "as_list",
    "candidates",
    "choose",
    "chosen",
    "note",
    "tuner_for",
]
