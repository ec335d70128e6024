"""``StepCounterHook``: logs and records training speed (steps/sec, examples/sec).

Example:
  >>> from hooks.base import SessionRunContext, SessionRunValues
  >>> hook = StepCounterHook(every_n_steps=10)
  >>> now = [0.0]
  >>> hook._clock = lambda: now[0]
  >>> hook.begin()
  >>> for loop in range(3):  # loops of 10 steps, 2 seconds each, batch 32
  ...     now[0] += 2.0
  ...     ctx = SessionRunContext(None, None, steps=range(10 * loop + 1, 10 * loop + 11),
  ...                             examples_per_step=32)
  ...     hook.after_run(ctx, SessionRunValues(None))
  >>> hook.steps_per_sec, hook.examples_per_sec
  (5.0, 160.0)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from hooks import _util
from hooks.base import HookSession, SessionRunContext, SessionRunHook, SessionRunValues
from hooks.timer import SecondOrStepTimer


class StepCounterHook(SessionRunHook):
    """Measures global steps per second (and examples per second) between reports.

    Speed is measured at loop boundaries (the only moments the host sees the device
    finish), over all steps since the previous report; the first loop boundary only starts
    the clock, so compilation is not counted. Reports are due once ``every_n_steps`` steps
    or ``every_n_secs`` seconds have passed since the previous one. Each report logs
    ``"global_step/sec: X"`` and, when ``run_context.examples_per_step > 0``,
    ``"examples/sec: Y"`` (logger ``"estimator"``), and writes the scalars
    ``global_step/sec`` and ``examples/sec`` to the summary writer if there is one.

    Args:
      every_n_steps: report every this many global steps (set to None to use seconds).
      every_n_secs: report every this many seconds.
      output_dir: a directory to create a ``tensorboardX.SummaryWriter`` in when no
        ``summary_writer`` is given.
      summary_writer: any object with ``add_scalar(tag, value, global_step)``.

    Attributes:
      steps_per_sec: the last computed global steps per second (None before).
      examples_per_sec: the last computed examples per second (None if unknown).

    Raises:
      ValueError: unless exactly one of ``every_n_steps``/``every_n_secs`` is given.
    """

    def __init__(
        self,
        every_n_steps: int | None = 100,
        every_n_secs: float | None = None,
        output_dir: str | None = None,
        summary_writer: Any = None,
    ):
        if (every_n_steps is None) == (every_n_secs is None):
            raise ValueError("exactly one of every_n_steps and every_n_secs should be provided.")
        self._timer = SecondOrStepTimer(every_steps=every_n_steps, every_secs=every_n_secs)
        self._output_dir = output_dir
        self._summary_writer = summary_writer
        self._owns_writer = False
        self._clock: Callable[[], float] = time.monotonic
        self.steps_per_sec: float | None = None
        self.examples_per_sec: float | None = None

    def begin(self) -> None:
        self._timer.reset()
        if self._summary_writer is None and self._output_dir:
            from tensorboardX import SummaryWriter

            # tensorboardX names files by the second and host only: a distinct suffix
            # keeps a writer opened in the same second (e.g. the estimator's) from
            # overwriting this one's file.
            suffix = f".{os.getpid()}.step_counter"
            self._summary_writer = SummaryWriter(self._output_dir, filename_suffix=suffix)
            self._owns_writer = True

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        step = _util.loop_end_step(run_context, None)
        if step is None:
            return
        now = self._clock()
        if not self._timer.should_trigger_for_step(step, now):
            return
        elapsed_secs, elapsed_steps = self._timer.update_last_triggered_step(step, now)
        if elapsed_secs is None or elapsed_steps is None or elapsed_secs <= 0:
            return
        if elapsed_steps <= 0:
            _util.logger.warning("Global step %d is not increasing; no speed reported.", step)
            return
        self._report(step, elapsed_steps / elapsed_secs, run_context.examples_per_step)

    def end(self, session: HookSession) -> None:
        if self._summary_writer is not None and hasattr(self._summary_writer, "flush"):
            self._summary_writer.flush()
        if self._owns_writer:
            self._summary_writer.close()
            self._summary_writer, self._owns_writer = None, False

    def _report(self, step: int, steps_per_sec: float, examples_per_step: int) -> None:
        self.steps_per_sec = steps_per_sec
        self.examples_per_sec = steps_per_sec * examples_per_step if examples_per_step else None
        _util.logger.info("global_step/sec: %g", steps_per_sec)
        if self.examples_per_sec is not None:
            _util.logger.info("examples/sec: %g", self.examples_per_sec)
        if self._summary_writer is not None:
            self._summary_writer.add_scalar("global_step/sec", steps_per_sec, step)
            if self.examples_per_sec is not None:
                self._summary_writer.add_scalar("examples/sec", self.examples_per_sec, step)
