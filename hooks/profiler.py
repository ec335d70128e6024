"""``ProfilerHook``: captures JAX profiler traces of chosen device loops.

Traces are written by ``jax.profiler`` as ``<output_dir>/plugins/profile/<run>/*.xplane.pb``
(plus a ``*.trace.json.gz``), the layout TensorBoard's profile plugin reads: point
TensorBoard at ``output_dir`` (by default the estimator's ``model_dir``).

Example:
  >>> hook = ProfilerHook(save_steps=1000, output_dir="/tmp/model")  # doctest: +SKIP
  >>> hook = ProfilerHook(output_dir="/tmp/model", steps=[500])  # the loop holding step 500
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from hooks import _util
from hooks.base import (
    HookSession,
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)
from hooks.timer import SecondOrStepTimer


class ProfilerHook(SessionRunHook):
    """Traces whole device loops with ``jax.profiler`` (TF's ``ProfilerHook``, for JAX).

    A loop is traced when it contains a step that is due: with ``save_steps``, the first
    loop after the compiling one, then the first loop ending at least ``save_steps`` steps
    after the last traced one; with ``save_secs``, likewise by time; with ``steps``, every
    loop containing one of those global steps (even the first). The trace starts in
    ``before_run`` and stops in ``after_run`` (the loop's results are on the host by then,
    so its device work is inside the trace). If another trace is already running in the
    process (JAX allows one), the loop is skipped with a warning.

    Args:
      save_steps: trace every this many steps.
      save_secs: trace every this many seconds.
      output_dir: trace directory; empty means the estimator's ``model_dir``.
      show_dataflow: accepted for TF compatibility; JAX traces always include the data flow.
      show_memory: accepted for TF compatibility; see ``jax.profiler.device_memory_profile``.
      steps: keyword-only: global steps whose loops to trace (instead of a cadence).

    Attributes:
      traced_steps: ``(first, last)`` global steps of each loop traced so far.

    Raises:
      ValueError: unless exactly one of ``save_steps``, ``save_secs`` and ``steps`` is given.
    """

    def __init__(
        self,
        save_steps: int | None = None,
        save_secs: float | None = None,
        output_dir: str = "",
        show_dataflow: bool = False,
        show_memory: bool = False,
        *,
        steps: Iterable[int] | None = None,
    ):
        given = [x is not None for x in (save_steps, save_secs, steps)]
        if sum(given) != 1:
            raise ValueError("Exactly one of save_steps, save_secs and steps should be provided.")
        self._timer = None if steps is not None else SecondOrStepTimer(save_secs, save_steps)
        self._steps = None if steps is None else {int(s) for s in steps}
        self._output_dir = output_dir
        self._show_dataflow = show_dataflow
        self._show_memory = show_memory
        self._clock: Callable[[], float] = time.monotonic
        self._tracing = False
        self._loops_seen = 0
        self.traced_steps: list[tuple[int, int]] = []

    def begin(self) -> None:
        if self._timer is not None:
            self._timer.reset()
        self._loops_seen = 0

    def after_create_session(self, session: HookSession, coord: Any) -> None:
        if not self._output_dir:
            self._output_dir = getattr(session, "model_dir", None) or "."

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs | None:
        steps = run_context.steps
        self._loops_seen += 1
        if self._due(steps):
            self._start(steps)
        return None

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        if not self._tracing:
            return
        self._stop()
        steps = run_context.steps
        if len(steps):
            self.traced_steps.append((int(steps[0]), int(steps[-1])))
            if self._timer is not None:
                self._timer.update_last_triggered_step(int(steps[-1]), self._clock())

    def end(self, session: HookSession) -> None:
        if self._tracing:  # a loop raised between before_run and after_run
            self._stop()

    def _due(self, steps: Any) -> bool:
        if self._steps is not None:
            return bool(self._steps.intersection(steps.tolist()))
        if self._loops_seen == 1 or not len(steps):  # the first loop mostly compiles
            return False
        return self._timer.should_trigger_for_step(int(steps[-1]), self._clock())

    def _start(self, steps: Any) -> None:
        import jax

        try:
            jax.profiler.start_trace(self._output_dir or ".")
        except RuntimeError as e:  # JAX runs one trace per process at a time
            _util.logger.warning("ProfilerHook: not tracing steps %s: %s", steps.tolist(), e)
            return
        self._tracing = True
        _util.logger.info(
            "Profiling steps %d-%d into %s.", int(steps[0]), int(steps[-1]), self._output_dir
        )

    def _stop(self) -> None:
        import jax

        self._tracing = False
        jax.profiler.stop_trace()
