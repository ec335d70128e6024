"""TF's checkpoint utilities: ``checkpoints_iterator``, ``latest_checkpoint``, ``list_variables``,
``load_variable``, and ``load_global_step`` (TF's private
``_load_global_step_from_checkpoint_dir``).

Checkpoints are directories named as TF named its checkpoint prefixes,
``<model_dir>/model.ckpt-<step>``, so ``int(path.split("-")[-1])`` is the step. Every function
here accepts such a step directory or a model_dir (its newest checkpoint); a model_dir written
before the rename (``<model_dir>/checkpoints/<step>``) reads too.

Example (a continuous evaluator, as TF programs write it):
  >>> for ckpt in estimator.checkpoints_iterator(model_dir, timeout=600):
  ...     results = est.evaluate(eval_input_fn, checkpoint_path=ckpt)
  ...     if int(ckpt.split("-")[-1]) >= train_steps:
  ...         break
"""

from __future__ import annotations

import difflib
import logging
import re
import time
from collections.abc import Callable, Iterator

import numpy as np

from .. import storage
from ..core.errors import EstimatorValueError
from .checkpoint import Checkpoints
from .checkpoint_read import moving_average_shapes, read_variables
from .model_dir import resolve_path
from .step_names import has_checkpoints, parse_step_path

log = logging.getLogger("estimator")

POLL_SECONDS = 1.0  # how often a waiting iterator looks for a new checkpoint (TF: 1 s)


def latest_checkpoint(checkpoint_dir: str) -> str | None:
    """The path of the newest complete checkpoint in ``checkpoint_dir`` (a model_dir), or None.

    Example:
      >>> estimator.latest_checkpoint("/runs/mnist")
      '/runs/mnist/model.ckpt-1000'
    """
    if not storage.isdir(checkpoint_dir) or not has_checkpoints(checkpoint_dir):
        return None
    ckpts = Checkpoints(checkpoint_dir, read_only=True)
    step = ckpts.newest_step()
    return None if step is None else ckpts.path(step)


def load_global_step(checkpoint_dir: str) -> int:
    """The global step of the newest checkpoint in ``checkpoint_dir``; 0 when there is none.

    TF's private ``_load_global_step_from_checkpoint_dir(model_dir)`` of
    ``tensorflow.python.estimator.estimator`` (exported under that name too), which the
    tensorflow/tpu mains (ResNet, EfficientNet, DCGAN, ...) call to decide how far training
    got. The public name follows ``load_variable``: it is
    ``load_variable(latest_checkpoint(dir), "global_step")`` with TF's 0 for a directory that
    is missing, empty or not a model_dir (a step directory too: TF looks for the newest
    checkpoint *in* the directory). Only the directory listing is read, no variable.

    Args:
      checkpoint_dir: a model_dir (a local path or a URL such as ``gs://bucket/run``).

    Returns:
      The step of its newest complete checkpoint, or 0.

    Example:
      >>> current_step = estimator.load_global_step("/runs/resnet")
      >>> while current_step < train_steps:
      ...     current_step = min(current_step + steps_per_eval, train_steps)
      ...     est.train(train_input_fn, max_steps=current_step)
    """
    path = latest_checkpoint(str(checkpoint_dir))
    parsed = None if path is None else parse_step_path(path)
    return 0 if parsed is None else parsed[1]


# TF's private name: ported mains keep their ``<estimator module>._load_global_step_...`` line.
_load_global_step_from_checkpoint_dir = load_global_step


def _wait_for_new_checkpoint(
    checkpoint_dir: str, last: str | None, *, timeout: float | None
) -> str | None:
    """The newest checkpoint once it differs from ``last``; None after ``timeout`` seconds."""
    stop = None if timeout is None else time.monotonic() + timeout
    while True:
        path = latest_checkpoint(checkpoint_dir)
        if path is not None and path != last:
            return path
        if stop is not None and time.monotonic() + POLL_SECONDS > stop:
            return None
        time.sleep(POLL_SECONDS)


def checkpoints_iterator(
    checkpoint_dir: str,
    min_interval_secs: float = 0,
    timeout: float | None = None,
    timeout_fn: Callable[[], bool] | None = None,
) -> Iterator[str]:
    """Yields each new newest checkpoint of ``checkpoint_dir`` as it appears (TF's semantics).

    It waits for a checkpoint newer than the last one yielded and yields its path (checkpoints
    written meanwhile are skipped: only the newest is yielded). When ``timeout`` seconds pass
    with none, it calls ``timeout_fn()``: True ends the iteration, False waits again; with no
    ``timeout_fn`` the iteration ends.

    Args:
      checkpoint_dir: the model_dir to watch (it need not exist yet).
      min_interval_secs: at least this many seconds between two yields.
      timeout: seconds to wait for a new checkpoint; None waits forever.
      timeout_fn: called after each timeout; returns True when no more checkpoints will come.

    Example:
      >>> for ckpt in checkpoints_iterator("/runs/mnist", timeout=600):
      ...     print(int(ckpt.split("-")[-1]))
    """
    last = None
    while True:
        path = _wait_for_new_checkpoint(checkpoint_dir, last, timeout=timeout)
        if path is None:
            if timeout_fn is None:
                log.info("Timed-out waiting for a checkpoint.")
                return
            if timeout_fn():
                return
            continue
        start = time.monotonic()
        last = path
        yield path
        left = start + min_interval_secs - time.monotonic()
        if left > 0:
            time.sleep(left)


def _resolve(ckpt_or_dir: str) -> tuple[Checkpoints, int]:
    model_dir, step = resolve_path(str(ckpt_or_dir), str(ckpt_or_dir))
    ckpts = Checkpoints(model_dir, read_only=True)
    if step is None:
        steps = ckpts.steps()
        if not steps:
            raise EstimatorValueError(f"No checkpoint found in {ckpt_or_dir}")
        step = steps[-1]
    return ckpts, step


def list_variables(ckpt_or_dir: str) -> list[tuple[str, list[int]]]:
    """``[(name, shape)]`` of every saved variable, sorted by name (TF's ``list_variables``).

    Names are those of ``TPUEstimator.get_variable_names()`` (``params`` by module path,
    other collections prefixed by their name), the shadows of an ``ExponentialMovingAverage``
    (``dense/kernel/ExponentialMovingAverage``) and ``global_step``; only the metadata is read.

    Example:
      >>> estimator.list_variables("/runs/mnist")[:2]
      [('Conv_0/bias', [32]), ('Conv_0/kernel', [5, 5, 1, 32])]
    """
    ckpts, step = _resolve(ckpt_or_dir)
    out = [("global_step", [])]
    shapes = {**ckpts.saved_shapes(step, "variables"), **moving_average_shapes(ckpts, step)}
    for name, shape in shapes.items():
        out.append((name, [int(d) for d in shape]))
    return sorted(out)


def load_variable(ckpt_or_dir: str, name: str) -> np.ndarray:
    """The saved value of one variable (TF's ``load_variable``); a ``:0`` suffix is ignored.

    Raises:
      ValueError: no checkpoint there, or no such variable (the message lists close names).

    Example:
      >>> estimator.load_variable("/runs/mnist/model.ckpt-1000", "Dense_1/bias").shape
      (10,)
    """
    name = re.sub(r":\d+$", "", name)
    variables = read_variables(str(ckpt_or_dir))
    if name not in variables:
        close = difflib.get_close_matches(name, list(variables), n=5, cutoff=0.5)
        raise EstimatorValueError(
            f"Variable {name!r} not found in checkpoint {ckpt_or_dir}; similar: {close}"
        )
    value = variables[name]
    return value.copy() if isinstance(value, np.ndarray) else value  # the caller's own


__all__ = [
    "checkpoints_iterator",
    "latest_checkpoint",
    "list_variables",
    "load_global_step",
    "load_variable",
]
