"""``StopAtStepHook``: stop training at a given global step.

Example:
  >>> from hooks.base import SessionRunContext, SessionRunValues
  >>> hook = StopAtStepHook(last_step=6)
  >>> ctx = SessionRunContext(None, None, steps=[4, 5, 6])
  >>> hook.after_run(ctx, SessionRunValues(None))
  >>> ctx.stop_requested
  True
"""

from __future__ import annotations

from typing import Any

from hooks import _util
from hooks.base import (
    HookSession,
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)


class StopAtStepHook(SessionRunHook):
    """Requests a stop once the global step reaches ``last_step``.

    ``num_steps`` is counted from the global step the session starts at (resolved in
    ``after_create_session``, so a resumed run trains ``num_steps`` more). The estimator
    asks ``planned_last_step`` to shorten the final device loop, so training lands exactly
    on it; a stop requested mid-loop takes effect at the loop's end.

    Args:
      num_steps: number of steps to run from the starting global step.
      last_step: the global step to stop at.

    Attributes:
      last_step: the step to stop at (``None`` until ``after_create_session`` when
        ``num_steps`` was given).

    Raises:
      ValueError: unless exactly one of ``num_steps``/``last_step`` is given.
    """

    def __init__(self, num_steps: int | None = None, last_step: int | None = None):
        if num_steps is None and last_step is None:
            raise ValueError("One of num_steps or last_step must be specified.")
        if num_steps is not None and last_step is not None:
            raise ValueError("Only one of num_steps or last_step can be specified.")
        if num_steps is not None and num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}.")
        self._num_steps = None if num_steps is None else int(num_steps)
        self.last_step: int | None = None if last_step is None else int(last_step)

    def after_create_session(self, session: HookSession, coord: Any) -> None:
        if self._num_steps is not None:
            self.last_step = int(session.global_step) + self._num_steps

    def planned_last_step(self, start_step: int) -> int | None:
        """``last_step``, or ``start_step + num_steps`` before the session resolved it."""
        return self.last_step if self.last_step is not None else start_step + self._num_steps

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs | None:
        # The estimator gives every step in run_context.steps; fetch only without them.
        return None if len(run_context.steps) else SessionRunArgs("global_step")

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        if self.last_step is None:
            return
        if run_values.results is not None and len(run_values.results):
            step = int(run_values.results[-1])
        else:
            step = _util.loop_end_step(run_context, None)
        if step is not None and step >= self.last_step:
            run_context.request_stop()
