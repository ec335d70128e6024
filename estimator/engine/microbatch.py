"""Gradient accumulation over micro-batches: ``TPUConfig(num_microbatches=k)``.

Each replica's batch of a step is split into ``k`` micro-batches of ``rows / k`` consecutive
rows, run one after another on the device (a ``lax.scan``, so only one micro-batch's
activations are live at a time), and their gradients averaged: one optimizer update per step,
and ``global_step`` counts updates. For a loss that is a mean over the batch the result is
the ``k=1`` gradient up to float reassociation.

What model_fn sees: ``params["batch_size"]`` is the micro-batch size; mutable collections
(BatchNorm statistics) are threaded through the micro-batches in order, so BatchNorm
normalises each micro-batch by its own statistics and its moving averages are updated ``k``
times per step (the "ghost batch" behaviour; it differs from ``k=1``); the loss reported is
the mean of the micro-batches' losses; host_call tensors are the micro-batches' rows
concatenated back in input order (a per-replica ``[1]`` tensor gives ``k`` rows).

Example:
  >>> loss, grads, new_state, host = accumulate(one, collections, features, labels, k=4)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from ..core.errors import EstimatorTypeError, EstimatorValueError
from ..parallel.mesh import DATA
from ..parallel.replica_context import is_varying


def micro_rows(rows: int, k: int) -> int:
    """Rows of one micro-batch; a per-replica batch ``k`` does not divide is an error."""
    if rows % k:
        raise EstimatorValueError(
            f"TPUConfig(num_microbatches={k}) must divide the per-replica train batch "
            f"({rows} rows): use a batch size that is a multiple of num_microbatches "
            "times the number of replicas"
        )
    return rows // k


def split(tree: Any, k: int) -> Any:
    """``[rows, ...]`` leaves as ``[k, rows / k, ...]``."""
    return jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), tree)


def merge(tree: Any) -> Any:
    """``[k, n, ...]`` leaves as ``[k * n, ...]``, micro-batch 0's rows first."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), tree)


def _varying(tree: Any) -> Any:
    # The scan carry must have one type in and out: per-replica gradients and collections
    # come out replica-varying, so the initial carry is cast to varying too.
    def one(x):
        return x if is_varying(x, DATA) else lax.pcast(x, DATA, to="varying")

    return jax.tree.map(one, tree)


OneMicrobatch = Callable[[Any, Any, Any, Any], tuple]


def accumulate(one: OneMicrobatch, collections: Any, params: Any, features, labels, k: int):
    """Runs ``one`` over ``k`` micro-batches in order and averages what it returns.

    Args:
      one: ``one(collections, features, labels, index) -> (loss, grads, new_collections,
        host)`` for one micro-batch (``index`` None when ``k == 1``).
      collections: the mutable collections at the start of the step.
      params: the parameters (the gradients' shapes and dtypes).
      features, labels: the replica's rows of the step.
      k: the number of micro-batches.

    Returns:
      ``(mean loss, mean grads, collections after the last micro-batch, host tensors)``.
    """
    if k == 1:
        return one(collections, features, labels, None)
    rows = jax.tree.leaves(features)[0].shape[0]
    micro_rows(rows, k)
    xs = (split(features, k), split(labels, k), jnp.arange(k, dtype=jnp.int32))

    def body(carry, x):
        colls, loss_sum, grad_sum = carry
        loss, grads, new, host = one(colls, *x)
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grad_sum, grads)
        return (new, loss_sum + loss, grad_sum), host

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
    init = _varying((collections, jnp.zeros((), jnp.float32), zeros))
    (colls, loss_sum, grad_sum), host = lax.scan(body, init, xs)
    grads = jax.tree.map(lambda g: g / k, grad_sum)
    return loss_sum / k, grads, colls, None if host is None else merge(host)


def check_opt_state(opt_state: Any) -> None:
    """Refuses an optimizer state made by ``optax.MultiSteps(...).gradient_transformation()``."""
    if isinstance(opt_state, optax.MultiStepsState):
        raise EstimatorTypeError(
            "train_op is optax.MultiSteps(...).gradient_transformation(): it accumulates over "
            "train steps, so global_step would count micro-batches. Use "
            "TPUConfig(num_microbatches=k) with the inner optimizer instead"
        )
