"""The evaluation ``loss``: the mean over exactly the real examples, masked in model_fn or not.

The last evaluation batch is padded to the compiled shape, so each replica's batch holds
``k`` real rows of ``b``. Two kinds of model_fn:

* it calls ``estimator.padding_mask()``: its loss is taken as the mean over its real rows,
  so the replica's rows sum to ``k * L``;
* it does not (TF programs take a plain ``mean()``): its loss is taken as a per-row mean
  ``L = (S + (b - k) * l_pad) / b`` (plus any constant, e.g. a regulariser), where ``l_pad``
  is the loss of a batch made only of padding rows, evaluated once per ``evaluate`` on the
  same variables; then the real rows sum to ``S = b * L - (b - k) * l_pad``.

Either way ``evaluate()["loss"]`` is the sum over the real rows divided by their number.

Example:
  >>> total = real_loss_sum(losses, mask, replicas=8, pad_losses=None)   # masked model_fn
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _real_rows(mask: np.ndarray, replicas: int) -> tuple[np.ndarray, int]:
    """Real rows per step and replica ``[n, R]``, and the rows of one replica's batch."""
    per_replica = mask.reshape(mask.shape[0], replicas, -1)
    return per_replica.sum(-1), per_replica.shape[-1]


def needs_pad_losses(mask: np.ndarray, replicas: int, *, masked: bool) -> bool:
    """Whether an unmasked loss of these steps needs the padding rows' loss to be exact."""
    if masked:
        return False
    k, b = _real_rows(mask, replicas)
    return bool(np.any((k > 0) & (k < b)))


def real_loss_sum(
    losses: np.ndarray, mask: np.ndarray, replicas: int, pad_losses: np.ndarray | None
) -> float:
    """The sum of the per-example losses of the real rows of one loop's steps.

    Args:
      losses: ``[n, R]`` the loss each replica's model_fn returned at each step.
      mask: ``[n, R * b]`` bool, the real rows (each counted once).
      replicas: ``R``.
      pad_losses: ``[R]`` each replica's loss on a batch of padding rows; None when the loss
        is masked (or no batch is partly padding).
    """
    k, b = _real_rows(mask, replicas)
    losses = np.asarray(losses, np.float64)[: k.shape[0]]
    if pad_losses is None:
        sums = losses * k
    else:
        sums = b * losses - (b - k) * np.asarray(pad_losses, np.float64)[None, :]
    return float(np.where(k > 0, sums, 0.0).sum())


def all_padding(chunk: Any) -> tuple[Any, Any, Any]:
    """``(features, labels, mask)`` shaped and placed like ``chunk``'s, every row padding
    (zeros, as the input pipeline pads)."""

    def zeros(x):
        return None if x is None else jnp.zeros(x.shape, x.dtype, device=x.sharding)

    features, labels, mask = jax.tree.map(zeros, (chunk.features, chunk.labels, chunk.mask))
    return features, labels, mask


__all__ = ["all_padding", "needs_pad_losses", "real_loss_sum"]
