"""train_and_evaluate: alternate training and evaluation in one process on the same devices.

Unlike TF's version there is no second session or device re-initialisation: evaluation is
another compiled loop of the same estimator, so each loop compiles exactly once over all rounds.

Example:
  >>> estimator.train_and_evaluate(
  ...     est, estimator.TrainSpec(train_input_fn, max_steps=1000),
  ...     estimator.EvalSpec(eval_input_fn, steps=None, throttle_secs=0))
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

log = logging.getLogger("estimator")


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """What to train on and for how long (TF's ``tf.estimator.TrainSpec``)."""

    input_fn: Callable
    max_steps: int | None = None
    hooks: Sequence = ()

    def __post_init__(self):
        if not callable(self.input_fn):
            raise TypeError(f"TrainSpec.input_fn must be callable, got {self.input_fn!r}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(f"TrainSpec.max_steps must be positive, got {self.max_steps}")


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What to evaluate on and when (TF's ``tf.estimator.EvalSpec``).

    Args:
      input_fn: the eval input.
      steps: batches per evaluation; None evaluates the whole input.
      name: evaluations are written under ``model_dir/eval_<name>``.
      hooks: hooks for every evaluation.
      exporters: accepted for compatibility; unused.
      start_delay_secs: no evaluation before this many seconds of training.
      throttle_secs: at least this many seconds between evaluations (0: after every
        checkpoint).
    """

    input_fn: Callable
    steps: int | None = 100
    name: str | None = None
    hooks: Sequence = ()
    exporters: Sequence = ()
    start_delay_secs: float = 120
    throttle_secs: float = 600

    def __post_init__(self):
        if not callable(self.input_fn):
            raise TypeError(f"EvalSpec.input_fn must be callable, got {self.input_fn!r}")
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"EvalSpec.steps must be positive or None, got {self.steps}")
        if self.throttle_secs < 0 or self.start_delay_secs < 0:
            raise ValueError("EvalSpec.throttle_secs and start_delay_secs must be >= 0")


def _global_step(est) -> int:
    path = est.latest_checkpoint()
    return 0 if path is None else int(path.rstrip("/").split("/")[-1])


def train_and_evaluate(est, train_spec: TrainSpec, eval_spec: EvalSpec) -> tuple[dict, list]:
    """Trains to ``train_spec.max_steps``, evaluating after checkpoints as the throttle
    allows and once at the end.

    Returns:
      ``(last eval results, [])`` (the empty list stands for TF's export results).
    """
    if not isinstance(train_spec, TrainSpec):
        raise TypeError(f"train_spec must be a TrainSpec, got {type(train_spec).__name__}")
    if not isinstance(eval_spec, EvalSpec):
        raise TypeError(f"eval_spec must be an EvalSpec, got {type(eval_spec).__name__}")
    every = est.config.save_checkpoints_steps or est.config.tpu_config.iterations_per_loop
    started = time.monotonic()
    last_eval_time, last_eval_step, result = None, None, None
    step = _global_step(est)

    def evaluate():
        nonlocal last_eval_time, last_eval_step, result
        result = est.evaluate(
            eval_spec.input_fn, steps=eval_spec.steps, hooks=eval_spec.hooks, name=eval_spec.name
        )
        last_eval_time, last_eval_step = time.monotonic(), step

    while train_spec.max_steps is None or step < train_spec.max_steps:
        target = step + every
        if train_spec.max_steps is not None:
            target = min(target, train_spec.max_steps)
        est.train(train_spec.input_fn, hooks=train_spec.hooks, max_steps=target)
        new_step = _global_step(est)
        progressed, step = new_step > step, new_step
        now = time.monotonic()
        if now - started >= eval_spec.start_delay_secs and (
            last_eval_time is None or now - last_eval_time >= eval_spec.throttle_secs
        ):
            evaluate()
        outcome = est.last_train_outcome
        if not progressed or step < target or (outcome and outcome.stopped_by_hook):
            log.info("Training stopped at step %d (input ended or a hook requested stop).", step)
            break
    if last_eval_step != step:
        evaluate()
    return result, []
