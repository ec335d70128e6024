"""``LoggingTensorHook``: logs fetched values at exact steps, TF-style.

Example:
  >>> import numpy as np
  >>> from hooks.base import SessionRunContext, SessionRunValues
  >>> hook = LoggingTensorHook({"loss": "loss", "step": "global_step"}, every_n_iter=2,
  ...                          formatter=lambda v: f"{v['step']}: {v['loss']:.2f}")
  >>> hook._log = print
  >>> ctx = SessionRunContext(None, None, steps=[1, 2, 3, 4])
  >>> hook.before_run(ctx).fetches
  {'loss': 'loss', 'step': 'global_step'}
  >>> hook.after_run(ctx, SessionRunValues(
  ...     {"loss": np.array([4.0, 3.0, 2.0, 1.0]), "step": np.array([1, 2, 3, 4])}))
  2: 3.00
  4: 1.00
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from hooks import _util
from hooks.base import (
    HookSession,
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)
from hooks.timer import SecondOrStepTimer


class LoggingTensorHook(SessionRunHook):
    """Logs the values of named tensors every N steps, every N seconds, and/or at the end.

    Lines go to the ``"estimator"`` logger at INFO, as in TF:
    ``"loss = 0.25, step = 6 (0.123 sec)"`` (dict tags sorted, list names in order; the
    seconds since the previous line are omitted on the first line).

    Cadence differs from TF in one useful way: ``every_n_iter=k`` logs the values OF the
    steps whose global step is a multiple of ``k`` (3, 6, 9, ... for k=3), taken from the
    per-step values of the loop, whatever ``iterations_per_loop`` is. (TF counted
    ``session.run`` calls, i.e. device loops, and logged the first one.) Seconds within a
    loop are estimated by spreading the loop's wall time evenly over its steps; with
    ``every_n_secs`` the first step seen is logged, then the first step at least that many
    seconds after the previous line.

    Args:
      tensors: a list of names, or a dict mapping tag -> name.
      every_n_iter: log the steps that are multiples of this.
      every_n_secs: log at most this often (exclusive with ``every_n_iter``).
      at_end: also log the last step's values in ``end()``.
      formatter: ``fn(dict tag -> value) -> str`` replacing the default line.

    Raises:
      ValueError: unless exactly one of every_n_iter/every_n_secs is given (both may be
        omitted when ``at_end=True``), or if one is not positive.
    """

    def __init__(
        self,
        tensors: Mapping[str, str] | Iterable[str],
        every_n_iter: int | None = None,
        every_n_secs: float | None = None,
        at_end: bool = False,
        formatter: Callable[[dict[str, Any]], str] | None = None,
    ):
        only_at_end = at_end and every_n_iter is None and every_n_secs is None
        if not only_at_end and (every_n_iter is None) == (every_n_secs is None):
            raise ValueError(
                "either at_end and/or exactly one of every_n_iter and every_n_secs must be "
                "provided."
            )
        if every_n_iter is not None and every_n_iter <= 0:
            raise ValueError(f"invalid every_n_iter={every_n_iter}.")
        if isinstance(tensors, str):
            tensors = [tensors]
        if isinstance(tensors, Mapping):
            self._tag_order = sorted(tensors)
            self._tensors = dict(tensors)
        else:
            self._tag_order = list(tensors)
            self._tensors = {name: name for name in self._tag_order}
        self._every_n_iter = every_n_iter
        self._secs_timer = (
            SecondOrStepTimer(every_secs=every_n_secs) if every_n_secs is not None else None
        )
        self._log_at_end = at_end
        self._formatter = formatter
        self._clock: Callable[[], float] = time.monotonic
        self._log: Callable[[str], None] = _util.logger.info
        self.begin()

    def begin(self) -> None:
        if self._secs_timer is not None:
            self._secs_timer.reset()
        self._last_log_time: float | None = None
        self._last_values: dict[str, Any] | None = None
        self._iter_count = 0  # steps seen; stands in for global steps if none are given
        self._loop_start = self._clock()

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs | None:
        self._loop_start = self._clock()
        steps = run_context.steps
        if self._log_at_end or self._secs_timer is not None or not len(steps):
            return SessionRunArgs(self._tensors)
        if np.any(steps % self._every_n_iter == 0):
            return SessionRunArgs(self._tensors)
        self._iter_count += len(steps)  # skipped loop: keep the fallback counter in sync
        return None

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        results = run_values.results
        n = _util.leading_dim(results)
        if not isinstance(results, Mapping) or not n:
            return
        steps = run_context.steps
        if len(steps) != n:
            steps = np.arange(self._iter_count + 1, self._iter_count + n + 1)
        self._iter_count += n
        times = _util.step_times(self._loop_start, self._clock(), n)
        for i, (step, now) in enumerate(zip(steps.tolist(), times.tolist(), strict=True)):
            if self._due(step, now):
                self._log_values({tag: results[tag][i] for tag in self._tag_order}, now)
        self._last_values = {tag: results[tag][-1] for tag in self._tag_order}

    def end(self, session: HookSession) -> None:
        if self._log_at_end and self._last_values is not None:
            self._log_values(self._last_values, self._clock())

    def _due(self, step: int, now: float) -> bool:
        if self._every_n_iter is not None:
            return step % self._every_n_iter == 0
        if self._secs_timer is not None and self._secs_timer.should_trigger_for_step(step, now):
            self._secs_timer.update_last_triggered_step(step, now)
            return True
        return False

    def _log_values(self, values: dict[str, Any], now: float) -> None:
        elapsed = None if self._last_log_time is None else now - self._last_log_time
        self._last_log_time = now
        if self._formatter is not None:
            self._log(self._formatter(values))
            return
        with np.printoptions(suppress=True):
            line = ", ".join(f"{tag} = {values[tag]}" for tag in self._tag_order)
        self._log(line if elapsed is None else f"{line} ({elapsed:.3f} sec)")
