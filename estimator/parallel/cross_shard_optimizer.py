"""``CrossShardOptimizer``: TF's gradient-averaging wrapper, which the estimator makes redundant.

In TF, ``tf.tpu.CrossShardOptimizer(opt)`` summed each shard's gradients across replicas
(with the loss scaled by ``1/num_shards``, so the sum is the mean). This estimator already
averages gradients over replicas before ``train_op`` sees them (``pmean`` over ``"data"``), so
the wrapper has nothing left to do: ``CrossShardOptimizer(tx)`` returns a transformation with
``tx``'s own state and updates, and ported code keeps its ``if use_tpu:`` line.

Example:
  >>> optimizer = optax.sgd(learning_rate)
  >>> if params["use_tpu"]:
  ...     optimizer = estimator.CrossShardOptimizer(optimizer)
  >>> spec = estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optimizer)
"""

from __future__ import annotations

from typing import Any

import optax
from jax import lax

from ..core.errors import EstimatorTypeError, EstimatorValueError
from .mesh import DATA
from .replica_context import get_replica_context

_MEAN = ("mean", "weighted_mean")
_SUM = ("sum", "weighted_sum")


def _reduction(reduction: Any) -> str:
    """``"mean"`` or ``"sum"`` from a string, a ``ReduceOp`` or TF's ``losses.Reduction``."""
    text = str(getattr(reduction, "value", reduction)).lower()
    if text in _MEAN:
        return "mean"
    if text in _SUM:
        return "sum"
    raise EstimatorValueError(
        f"CrossShardOptimizer reduction must be MEAN or SUM (TF's losses.Reduction.MEAN/SUM), "
        f"got {reduction!r}"
    )


def _num_replicas() -> int:
    """Replicas the gradient was averaged over: the size of ``"data"`` where it is bound."""
    try:
        return int(lax.axis_size(DATA))
    except NameError:  # not inside the estimator's shard_map: the strategy's context (or 1)
        return int(get_replica_context().num_replicas_in_sync)


def CrossShardOptimizer(  # noqa: N802 - TF's name
    tx: optax.GradientTransformation,
    reduction: Any = "mean",
    name: str = "CrossShardOptimizer",
    group_assignment: Any = None,
) -> optax.GradientTransformation:
    """Returns ``tx`` unchanged in effect: gradients are already averaged over replicas.

    Args:
      tx: the optimizer (an ``optax.GradientTransformation``).
      reduction: ``"mean"`` (TF's default ``losses.Reduction.MEAN``): the updates are exactly
        ``tx``'s. ``"sum"`` (``losses.Reduction.SUM``): gradients are the *sum* over replicas,
        as TF's SUM gave, i.e. the averaged gradient times the number of replicas.
      name: accepted for TF compatibility; unused.
      group_assignment: TF's sub-group averaging; only ``None`` (all replicas) is supported.

    Returns:
      A GradientTransformation with ``tx``'s state structure (checkpoints written with and
      without the wrapper are interchangeable).

    Raises:
      ValueError: another reduction, or a ``group_assignment``.

    TF clipped or otherwise transformed each shard's gradient inside the wrapper, before the
    cross-replica sum; here every transformation in ``tx`` sees the already-averaged gradient
    (e.g. ``optax.clip_by_global_norm`` clips the mean, not each shard's gradient).

    Example:
      >>> tx = CrossShardOptimizer(optax.sgd(0.1))      # same updates as optax.sgd(0.1)
    """
    del name
    if not isinstance(tx, optax.GradientTransformation):
        raise EstimatorTypeError(
            f"CrossShardOptimizer wraps an optax.GradientTransformation, got {type(tx).__name__}"
        )
    kind = _reduction(reduction)
    if group_assignment is not None:
        raise EstimatorValueError(
            "CrossShardOptimizer(group_assignment=...) is not supported: the estimator averages "
            "gradients over all replicas"
        )
    if kind == "mean":
        return optax.GradientTransformation(tx.init, tx.update)

    def update(updates, state, params=None):
        n = _num_replicas()
        summed = updates if n == 1 else optax.tree_utils.tree_scale(n, updates)
        return tx.update(summed, state, params)

    return optax.GradientTransformation(tx.init, update)


__all__ = ["CrossShardOptimizer"]
