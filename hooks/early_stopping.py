"""Early stopping on eval results, as in ``tf.estimator.experimental``.

The hooks read the eval results the estimator writes as TensorBoard scalars to its eval
directory (``estimator.eval_dir()``, i.e. ``<model_dir>/eval``), so they need evaluations
running alongside training: ``train_and_evaluate``, or a separate evaluator process. They
check at loop boundaries, at most every ``run_every_secs`` seconds or ``run_every_steps``
steps, and stop training at the end of the loop.

Example:
  >>> hook = stop_if_no_decrease_hook(estimator, "loss", max_steps_without_decrease=1000,
  ...                                 run_every_secs=None, run_every_steps=100)
  ... # doctest: +SKIP
  >>> estimator.train(input_fn, hooks=[hook])  # doctest: +SKIP
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from typing import Any

from hooks import _util
from hooks.base import SessionRunContext, SessionRunHook, SessionRunValues
from hooks.event_reader import read_eval_metrics
from hooks.timer import SecondOrStepTimer

_Evaluations = list[tuple[int, float]]  # (global step, metric value), in step order


def make_early_stopping_hook(
    estimator: Any,
    should_stop_fn: Callable[[], bool],
    run_every_secs: float | None = 60,
    run_every_steps: int | None = None,
) -> SessionRunHook:
    """A hook that stops training when ``should_stop_fn()`` returns True.

    ``should_stop_fn`` is called at the first loop boundary, then at most every
    ``run_every_secs`` seconds or ``run_every_steps`` steps. Unlike TF, passing
    ``run_every_steps`` alone is enough: it takes precedence over the default
    ``run_every_secs``.

    Args:
      estimator: the estimator being trained (unused; kept for TF's signature).
      should_stop_fn: a no-argument callable returning whether to stop.
      run_every_secs: seconds between checks.
      run_every_steps: global steps between checks.

    Returns:
      A ``SessionRunHook``.

    Raises:
      TypeError: if ``should_stop_fn`` is not callable.
      ValueError: if neither interval is given.

    Example:
      >>> hook = make_early_stopping_hook(None, lambda: True, run_every_secs=None,
      ...                                 run_every_steps=10)
    """
    del estimator
    if run_every_steps is not None:
        run_every_secs = None
    return _StopOnPredicateHook(should_stop_fn, run_every_secs, run_every_steps)


def stop_if_higher_hook(
    estimator: Any,
    metric_name: str,
    threshold: float,
    eval_dir: str | None = None,
    min_steps: int = 0,
    run_every_secs: float | None = 60,
    run_every_steps: int | None = None,
) -> SessionRunHook:
    """Stops training once ``metric_name`` in some evaluation is higher than ``threshold``.

    Args:
      estimator: the estimator (``eval_dir()``/``model_dir`` locate the eval results).
      metric_name: a metric of the eval results, e.g. ``"accuracy"``.
      threshold: the value to exceed.
      eval_dir: where the eval event files are; default ``estimator.eval_dir()``.
      min_steps: ignore evaluations of checkpoints before this global step.
      run_every_secs: seconds between checks.
      run_every_steps: global steps between checks (takes precedence).

    Returns:
      A ``SessionRunHook``.
    """
    should_stop = _crossed(metric_name, threshold, higher_is_better=True)
    return _metric_hook(
        estimator, metric_name, eval_dir, min_steps, run_every_secs, run_every_steps, should_stop
    )


def stop_if_lower_hook(
    estimator: Any,
    metric_name: str,
    threshold: float,
    eval_dir: str | None = None,
    min_steps: int = 0,
    run_every_secs: float | None = 60,
    run_every_steps: int | None = None,
) -> SessionRunHook:
    """Stops training once ``metric_name`` in some evaluation is lower than ``threshold``.

    Arguments as in ``stop_if_higher_hook``.
    """
    should_stop = _crossed(metric_name, threshold, higher_is_better=False)
    return _metric_hook(
        estimator, metric_name, eval_dir, min_steps, run_every_secs, run_every_steps, should_stop
    )


def stop_if_no_increase_hook(
    estimator: Any,
    metric_name: str,
    max_steps_without_increase: int,
    eval_dir: str | None = None,
    min_steps: int = 0,
    run_every_secs: float | None = 60,
    run_every_steps: int | None = None,
) -> SessionRunHook:
    """Stops training if ``metric_name`` has not increased for that many global steps.

    Evaluations (from ``min_steps`` on) are scanned in step order; training stops when an
    evaluation is ``max_steps_without_increase`` or more steps after the best one so far.

    Args:
      estimator: the estimator (``eval_dir()``/``model_dir`` locate the eval results).
      metric_name: a metric of the eval results, e.g. ``"accuracy"``.
      max_steps_without_increase: global steps allowed without a new best value.
      eval_dir: where the eval event files are; default ``estimator.eval_dir()``.
      min_steps: ignore evaluations of checkpoints before this global step.
      run_every_secs: seconds between checks.
      run_every_steps: global steps between checks (takes precedence).

    Returns:
      A ``SessionRunHook``.
    """
    should_stop = _stalled(metric_name, max_steps_without_increase, higher_is_better=True)
    return _metric_hook(
        estimator, metric_name, eval_dir, min_steps, run_every_secs, run_every_steps, should_stop
    )


def stop_if_no_decrease_hook(
    estimator: Any,
    metric_name: str,
    max_steps_without_decrease: int,
    eval_dir: str | None = None,
    min_steps: int = 0,
    run_every_secs: float | None = 60,
    run_every_steps: int | None = None,
) -> SessionRunHook:
    """Stops training if ``metric_name`` has not decreased for that many global steps.

    Arguments as in ``stop_if_no_increase_hook``.
    """
    should_stop = _stalled(metric_name, max_steps_without_decrease, higher_is_better=False)
    return _metric_hook(
        estimator, metric_name, eval_dir, min_steps, run_every_secs, run_every_steps, should_stop
    )


class _StopOnPredicateHook(SessionRunHook):
    """Calls ``should_stop_fn`` on a timer at loop boundaries; stops when it says so."""

    def __init__(
        self,
        should_stop_fn: Callable[[], bool],
        run_every_secs: float | None,
        run_every_steps: int | None,
    ):
        if not callable(should_stop_fn):
            raise TypeError("`should_stop_fn` must be callable.")
        self._should_stop_fn = should_stop_fn
        self._timer = SecondOrStepTimer(every_secs=run_every_secs, every_steps=run_every_steps)
        self._clock: Callable[[], float] = time.monotonic
        self.stopped_at_step: int | None = None

    def begin(self) -> None:
        self._timer.reset()

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        step = _util.loop_end_step(run_context, None)
        if step is None:
            return
        now = self._clock()
        if not self._timer.should_trigger_for_step(step, now):
            return
        self._timer.update_last_triggered_step(step, now)
        if self._should_stop_fn():
            _util.logger.info("Requesting early stopping at global step %d", step)
            self.stopped_at_step = step
            run_context.request_stop()


def _resolve_eval_dir(estimator: Any, eval_dir: str | None) -> str:
    if eval_dir:
        return eval_dir
    if hasattr(estimator, "eval_dir"):
        return estimator.eval_dir()
    return f"{str(estimator.model_dir).rstrip('/')}/eval"


def _metric_values(eval_dir: str, metric_name: str, min_steps: int) -> _Evaluations:
    """(step, value) of ``metric_name`` per evaluation at or after ``min_steps``."""
    results = read_eval_metrics(eval_dir)
    found = [(s, m[metric_name]) for s, m in results.items() if metric_name in m]
    if results and not found:
        tags = sorted({tag for metrics in results.values() for tag in metrics})
        raise ValueError(
            f'Metric "{metric_name}" is not in the eval results in {eval_dir}; found: {tags}.'
        )
    return [(step, value) for step, value in found if step >= min_steps]


def _metric_hook(
    estimator: Any,
    metric_name: str,
    eval_dir: str | None,
    min_steps: int,
    run_every_secs: float | None,
    run_every_steps: int | None,
    should_stop: Callable[[_Evaluations], bool],
) -> SessionRunHook:
    """A hook that stops once ``should_stop`` holds for the evaluations of ``metric_name``."""
    eval_dir = _resolve_eval_dir(estimator, eval_dir)

    def should_stop_fn() -> bool:
        return should_stop(_metric_values(eval_dir, metric_name, min_steps))

    return make_early_stopping_hook(estimator, should_stop_fn, run_every_secs, run_every_steps)


def _crossed(
    metric_name: str, threshold: float, *, higher_is_better: bool
) -> Callable[[_Evaluations], bool]:
    """Whether some evaluation is past ``threshold`` (above it if ``higher_is_better``)."""
    is_better = operator.gt if higher_is_better else operator.lt
    relation = "greater than" if higher_is_better else "less than"

    def stop_if_threshold_crossed(evaluations: _Evaluations) -> bool:
        for step, value in evaluations:
            if is_better(value, threshold):
                _util.logger.info(
                    'At step %s, metric "%s" has value %s which is %s the configured '
                    "threshold (%s) for early stopping.",
                    step,
                    metric_name,
                    value,
                    relation,
                    threshold,
                )
                return True
        return False

    return stop_if_threshold_crossed


def _stalled(
    metric_name: str, max_steps_without_improvement: int, *, higher_is_better: bool
) -> Callable[[_Evaluations], bool]:
    """Whether some evaluation comes that many steps or more after the best one before it."""
    is_better = operator.gt if higher_is_better else operator.lt
    direction = "increase" if higher_is_better else "decrease"

    def stop_if_no_metric_improvement(evaluations: _Evaluations) -> bool:
        best_value, best_step = None, None
        for step, value in evaluations:
            if best_value is None or is_better(value, best_value):
                best_value, best_step = value, step
            if step - best_step >= max_steps_without_improvement:
                _util.logger.info(
                    'No %s in metric "%s" for %s steps, which is greater than or equal to '
                    "max steps (%s) configured for early stopping.",
                    direction,
                    metric_name,
                    step - best_step,
                    max_steps_without_improvement,
                )
                return True
        return False

    return stop_if_no_metric_improvement
