"""Training state sharded over the data-parallel replicas (ZeRO stages 1-3, FSDP).

Replicated data parallelism keeps a whole copy of the parameters and of the optimizer state on
every replica. ``TPUConfig(shard_optimizer_state=True)`` keeps 1/R of the optimizer state on
each of the R replicas (ZeRO-1/2) and ``TPUConfig(shard_params=True)`` the parameters as well
(ZeRO-3 / FSDP). These are the rules that decide how a leaf is split:

* a leaf with fewer than ``MIN_SHARDED_SIZE`` elements stays replicated (sharding it saves
  little memory and costs a collective per step);
* otherwise it is split over ``"data"`` along its largest dimension that ``R`` divides and that
  is not already split over ``"model"`` (ties: the first such dimension); a leaf with no such
  dimension stays replicated;
* a ``"model"``-axis split (``nn.with_partitioning``) is kept: the data split goes on another
  dimension, so ``P(None, "model")`` becomes ``P("data", "model")``;
* an optimizer-state leaf that mirrors a parameter (Adam's ``mu`` and ``nu``, momentum) takes
  that parameter's sharding; every other leaf (step counts) stays replicated.

The functions are pure: shapes and specs in, specs out. The train loop uses them to
reduce-scatter gradients and to keep the state laid out this way between steps.

Example:
  >>> shard_dim((64, 512), P(), num_replicas=8)
  1
  >>> sharded_spec((64, 512), P(None, "model"), num_replicas=8)
  PartitionSpec('data', 'model')
  >>> sharded_spec((10,), P(), num_replicas=8)          # small: replicated
  PartitionSpec()
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .mesh import DATA

PyTree = Any

#: Leaves with fewer elements than this stay replicated (4 KiB of float32).
MIN_SHARDED_SIZE = 1024


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _entries(spec: P, ndim: int) -> list:
    entries = list(spec) + [None] * (ndim - len(spec))
    return entries[:ndim]


def shard_dim(
    shape: tuple[int, ...],
    model_spec: P | None,
    *,
    num_replicas: int,
    min_size: int = MIN_SHARDED_SIZE,
) -> int | None:
    """The dimension a leaf of ``shape`` is split along over ``"data"``, or None (replicated).

    Args:
      shape: the leaf's global shape.
      model_spec: its ``"model"``-axis PartitionSpec (``P()`` or None: not model-parallel).
      num_replicas: R, the size of the ``"data"`` axis.
      min_size: leaves with fewer elements stay replicated.
    """
    shape = tuple(int(s) for s in shape)
    if num_replicas <= 1 or math.prod(shape) < min_size:
        return None
    taken = _entries(model_spec or P(), len(shape))
    best = None
    for i, size in enumerate(shape):
        if taken[i] is not None or size % num_replicas:
            continue
        if best is None or size > shape[best]:
            best = i
    return best


def sharded_spec(
    shape: tuple[int, ...],
    model_spec: P | None,
    *,
    num_replicas: int,
    min_size: int = MIN_SHARDED_SIZE,
) -> P:
    """The leaf's global PartitionSpec: its ``"model"`` split plus the ``"data"`` split."""
    entries = _entries(model_spec or P(), len(shape))
    dim = shard_dim(shape, model_spec, num_replicas=num_replicas, min_size=min_size)
    if dim is not None:
        entries[dim] = DATA
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def data_only(spec: P) -> P:
    """The ``"data"`` part of a spec: what a ``shard_map`` manual over ``"data"`` names."""
    entries = [DATA if e == DATA else None for e in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def data_dim(spec: P) -> int | None:
    """The dimension ``spec`` splits over ``"data"`` (None: replicated over replicas)."""
    for i, e in enumerate(spec):
        if e == DATA:
            return i
    return None


def resolved_model_specs(params: PyTree, model_specs: PyTree | None) -> PyTree:
    """``model_specs``, or ``P()`` for every parameter when it is None."""
    if model_specs is None:
        return jax.tree.map(lambda _: P(), params)
    return model_specs


def param_specs(
    params: PyTree,
    model_specs: PyTree | None,
    *,
    num_replicas: int,
    min_size: int = MIN_SHARDED_SIZE,
) -> PyTree:
    """``sharded_spec`` of every parameter (arrays or ``ShapeDtypeStruct`` leaves).

    ``model_specs`` is the tree of ``"model"``-axis specs (``partitioning.param_specs``), or
    None when nothing is model-parallel.
    """
    return jax.tree.map(
        lambda spec, x: sharded_spec(x.shape, spec, num_replicas=num_replicas, min_size=min_size),
        resolved_model_specs(params, model_specs),
        params,
        is_leaf=_is_spec,
    )


def optimizer_specs(
    tx: optax.GradientTransformation, opt_state: PyTree, params: PyTree, specs: PyTree
) -> PyTree:
    """PartitionSpecs of ``opt_state`` leaves: a parameter's copies take its spec.

    Copies are found with ``optax.tree_utils.tree_map_params`` (optax's own map from the
    parameter tree to its copies in a state). When a transform's ``init`` cannot run on that
    function's placeholder, shapes decide instead: a leaf shaped like a parameter takes that
    parameter's spec (the first such parameter's). Everything else (counts, a schedule's
    state) is replicated.

    Args:
      tx: the optimizer.
      opt_state: its state (arrays or ``ShapeDtypeStruct`` leaves).
      params: the parameters (arrays or ``ShapeDtypeStruct`` leaves).
      specs: one PartitionSpec per parameter.
    """
    try:
        return optax.tree_utils.tree_map_params(
            tx, lambda _, spec: spec, opt_state, specs, transform_non_params=lambda _: P()
        )
    except Exception:  # noqa: BLE001 - a user transform's init may fail on a placeholder
        pass
    by_shape: dict = {}
    for x, spec in zip(
        jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=_is_spec), strict=True
    ):
        by_shape.setdefault(tuple(x.shape), spec)
    return jax.tree.map(lambda x: by_shape.get(tuple(getattr(x, "shape", ())), P()), opt_state)


def named(mesh: Mesh, specs: PyTree) -> PyTree:
    """NamedShardings on ``mesh`` for a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def scatter_gradients(grads: PyTree, specs: PyTree) -> PyTree:
    """Inside a ``shard_map`` over ``"data"``: the global-mean gradient, split as ``specs``.

    A leaf split over ``"data"`` is reduce-scattered (``psum_scatter`` along its split
    dimension, divided by R): each replica keeps the mean of its 1/R slice. A replicated leaf
    is ``pmean``-ed. ``grads`` must be replica-varying (params cast with ``pcast`` before
    ``grad``; see "The gradient trap" in docs/strategy.md).
    """
    replicas = lax.axis_size(DATA)
    # As the replicated loop's mean_gradients: XLA:CPU fails to compile cross-device sums of
    # bfloat16/float16, so on CPU they are summed in float32.
    upcast = jax.default_backend() == "cpu"

    def one(spec: P, g: jax.Array) -> jax.Array:
        dtype = g.dtype
        if upcast and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
            g = g.astype(jnp.float32)
        dim = data_dim(spec)
        if dim is None:
            return lax.pmean(g, DATA).astype(dtype)
        return (lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True) / replicas).astype(
            dtype
        )

    return jax.tree.map(one, specs, grads, is_leaf=_is_spec)


def _low_precision_on_cpu(dtype) -> bool:
    # XLA:CPU fails to compile cross-device sums of bfloat16/float16 (see scatter_gradients);
    # a gather's transpose is such a sum (a reduce-scatter).
    return (
        jax.default_backend() == "cpu"
        and jnp.issubdtype(dtype, jnp.floating)
        and jnp.finfo(dtype).bits < 32
    )


def gather_params(shards: PyTree, specs: PyTree) -> PyTree:
    """Inside a ``shard_map`` over ``"data"``: each split parameter whole again, one gather each.

    Every split leaf is ``all_gather``-ed along its split dimension. Under
    ``fsdp.gathered_at_use`` each gather is held back to the operation that uses the
    parameter, and done again for its backward pass: a step holds the slices plus the layer
    in use, not the whole model. The transpose of the gather is a reduce-scatter, so
    ``jax.grad`` through this function returns each leaf's gradient summed over replicas
    and already split as ``specs`` (``scattered_mean`` divides by R). Replicated leaves
    pass through.
    """

    def one(spec: P, x: jax.Array) -> jax.Array:
        dim = data_dim(spec)
        if dim is None:
            return x
        dtype = x.dtype
        if _low_precision_on_cpu(dtype):
            x = x.astype(jnp.float32)
        return lax.all_gather(x, DATA, axis=dim, tiled=True).astype(dtype)

    return jax.tree.map(one, specs, shards, is_leaf=_is_spec)


def scattered_mean(grads: PyTree, specs: PyTree) -> PyTree:
    """The global-mean gradient from ``jax.grad`` through ``gather_params``.

    A split leaf's gradient arrives summed over replicas by the gather's transpose (a
    reduce-scatter): divided by R. A replicated leaf's gradient is still the replica's own
    (its parameter was cast to replica-varying): ``pmean``-ed.
    """
    replicas = lax.axis_size(DATA)

    def one(spec: P, g: jax.Array) -> jax.Array:
        if data_dim(spec) is not None:
            return g / replicas
        dtype = g.dtype
        if _low_precision_on_cpu(dtype):
            g = g.astype(jnp.float32)
        return lax.pmean(g, DATA).astype(dtype)

    return jax.tree.map(one, specs, grads, is_leaf=_is_spec)


def constrain(tree: PyTree, mesh: Mesh, specs: PyTree) -> PyTree:
    """``with_sharding_constraint`` of every leaf to its spec on ``mesh`` (outside shard_map)."""
    return jax.tree.map(
        lambda s, x: lax.with_sharding_constraint(x, NamedSharding(mesh, s)),
        specs,
        tree,
        is_leaf=_is_spec,
    )


def bytes_per_device(tree: PyTree) -> int:
    """Bytes one device holds of ``tree`` (its shard of every array leaf)."""
    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize
    return int(total)


def state_shardings(
    mesh: Mesh,
    tx: optax.GradientTransformation,
    params: PyTree,
    opt_state: PyTree,
    model_specs: PyTree | None,
    *,
    shard_params: bool,
) -> tuple[PyTree, PyTree]:
    """(parameter, optimizer-state) NamedShardings at rest between steps.

    Parameters keep their ``"model"`` specs unless ``shard_params``; the optimizer state is
    always split (``optimizer_specs``). Leaves may be arrays or ``ShapeDtypeStruct``.
    """
    sharded = param_specs(params, model_specs, num_replicas=mesh.shape[DATA])
    at_rest = sharded if shard_params else resolved_model_specs(params, model_specs)
    return named(mesh, at_rest), named(mesh, optimizer_specs(tx, opt_state, params, sharded))
