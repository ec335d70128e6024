"""Model parallelism inside a replica: sharding annotations and parameter placement.

Each replica runs on one row of the ``("data", "model")`` mesh: ``num_cores_per_replica``
devices along ``"model"``. Inside the replica the compiler (GSPMD) partitions the computation
over ``"model"``; these helpers tell it how.

Activations, inside ``TPUStrategy.run`` or ``model_fn`` (TF's logical-device annotations):

    h = split_to_logical_devices(h, [1, 2], num_cores_per_replica=2)   # columns over 2 cores
    y = replicate_to_logical_devices(y)                                # whole on every core

Parameters created with Flax partitioning metadata are sharded over ``"model"``, so each device
holds ``1 / num_cores_per_replica`` of them:

    dense = nn.Dense(512, kernel_init=nn.with_partitioning(init, (None, "model")))
    variables = shard_variables(mesh, model.init(rng, x))       # unboxed, placed on the mesh

Everything here is pure: functions of their arguments, no global state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax.core import meta
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.errors import EstimatorValueError
from .mesh import MODEL

PyTree = Any
Rules = Mapping[str, str | None] | Sequence[tuple[str, str | None]]

#: Default map from partition names in Flax metadata to mesh axes: only ``"model"`` shards.
DEFAULT_RULES: Mapping[str, str | None] = {"model": MODEL}


def partition_spec_from_dims(
    partition_dimensions: Sequence[int] | None,
    *,
    num_cores_per_replica: int | None = None,
    batch_axis: str | None = None,
) -> P:
    """Turns TF partition dimensions (cores per tensor dimension) into a ``PartitionSpec``.

    This is what ``TPUConfig.input_partition_dims`` and ``experimental_split_to_logical_devices``
    mean: ``partition_dimensions[i]`` is how many cores dimension ``i`` is split over. The
    mesh has one model axis, so at most one dimension may be split, and (as in TF) the product
    must equal ``num_cores_per_replica`` when that is given.

    Args:
      partition_dimensions: one positive int per tensor dimension, or None (not split).
      num_cores_per_replica: if given, the product of ``partition_dimensions`` must equal it.
      batch_axis: if given (e.g. ``"data"``), dimension 0 is also split over this axis: the
        spec of a global input batch rather than of a per-replica tensor.

    Returns:
      A ``PartitionSpec`` over ``"model"`` (and ``batch_axis``).

    Raises:
      ValueError: non-positive entries, two split dimensions, or a wrong product.

    Example:
      >>> partition_spec_from_dims([1, 2, 1], num_cores_per_replica=2)
      PartitionSpec(None, 'model', None)
      >>> partition_spec_from_dims([2, 1], batch_axis="data")
      PartitionSpec(('data', 'model'), None)
      >>> partition_spec_from_dims(None, batch_axis="data")
      PartitionSpec('data',)
    """
    if partition_dimensions is None:
        return P(batch_axis) if batch_axis else P()
    dims = [int(d) for d in partition_dimensions]
    if any(d < 1 for d in dims):
        raise EstimatorValueError(f"partition dimensions must be positive, got {list(dims)}")
    split = [i for i, d in enumerate(dims) if d > 1]
    if len(split) > 1:
        raise EstimatorValueError(
            f"partition dimensions {dims} split {len(split)} dimensions; the mesh has one "
            f"'{MODEL}' axis, so at most one dimension can be split"
        )
    if num_cores_per_replica is not None and math.prod(dims) != num_cores_per_replica:
        raise EstimatorValueError(
            f"the product of partition dimensions {dims} is {math.prod(dims)}, but each "
            f"replica has num_cores_per_replica={num_cores_per_replica} logical devices"
        )
    entries: list[Any] = [MODEL if d > 1 else None for d in dims]
    if batch_axis:
        if not entries:
            entries = [batch_axis]
        else:
            entries[0] = batch_axis if entries[0] is None else (batch_axis, entries[0])
    return P(*entries)


def _constrain(x: PyTree, spec: P, mesh: Mesh | None) -> PyTree:
    # Inside shard_map only a bare PartitionSpec works (a NamedSharding names the manual
    # "data" axis as Auto and is rejected); outside one, a bare spec needs a mesh context.
    sharding = spec if mesh is None else NamedSharding(mesh, spec)
    return jax.tree.map(lambda a: lax.with_sharding_constraint(a, sharding), x)


def split_to_logical_devices(
    x: jax.Array,
    partition_dimensions: Sequence[int],
    *,
    num_cores_per_replica: int,
    mesh: Mesh | None = None,
) -> jax.Array:
    """Shards ``x`` within the replica: dimension ``i`` over ``partition_dimensions[i]`` cores.

    A sharding annotation (``lax.with_sharding_constraint`` with a bare ``PartitionSpec``)
    for code traced inside ``TPUStrategy.run`` or ``model_fn``; values are unchanged. Pass
    ``mesh`` to use it outside a replicated computation (the whole array, on ``mesh``).

    Raises:
      ValueError: as TF: the dims do not match ``x``'s rank, their product is not
        ``num_cores_per_replica``, or a dimension is not divisible by its split.
    """
    dims = list(partition_dimensions)
    if len(dims) != x.ndim:
        raise EstimatorValueError(
            f"partition_dimensions {dims} has {len(dims)} entries for a tensor of rank "
            f"{x.ndim} (shape {tuple(x.shape)})"
        )
    spec = partition_spec_from_dims(dims, num_cores_per_replica=num_cores_per_replica)
    for size, d in zip(x.shape, dims, strict=True):
        if size % d:
            raise EstimatorValueError(
                f"tensor shape {tuple(x.shape)} is not divisible by partition dimensions {dims}"
            )
    if num_cores_per_replica == 1:
        return x  # nothing to partition; also needs no mesh (e.g. un-replicated model_fn)
    return _constrain(x, spec, mesh)


def replicate_to_logical_devices(x: PyTree, *, mesh: Mesh | None = None) -> PyTree:
    """Keeps every leaf of ``x`` whole on each core of the replica (constraint ``P()``)."""
    return _constrain(x, P(), mesh)


def assign_to_logical_device(
    x: PyTree, logical_device_id: int, *, num_cores_per_replica: int, mesh: Mesh | None = None
) -> PyTree:
    """TF's single-core placement; in JAX the value is replicated over the replica's cores.

    GSPMD cannot pin a value to one device of a partitioned (or manual) region: the closest
    annotation is "every core holds it", which gives the same results and costs memory on
    every core. Use ``split_to_logical_devices`` to actually spread work.

    Raises:
      ValueError: ``logical_device_id`` is not in ``[0, num_cores_per_replica)``.
    """
    if not 0 <= int(logical_device_id) < num_cores_per_replica:
        raise EstimatorValueError(
            f"logical_device_id {logical_device_id} out of range: each replica has "
            f"{num_cores_per_replica} logical devices"
        )
    if num_cores_per_replica == 1:
        return x
    return replicate_to_logical_devices(x, mesh=mesh)


def _is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


def _rules_dict(rules: Rules | None) -> dict[str, str | None]:
    if rules is None:
        return dict(DEFAULT_RULES)
    return dict(rules.items() if isinstance(rules, Mapping) else rules)


def _spec_of(path: Any, leaf: Any, rules: dict[str, str | None]) -> P:
    if not isinstance(leaf, meta.Partitioned):
        return P()
    value, names = leaf.value, tuple(leaf.names)
    ndim = len(getattr(value, "shape", ()))
    if len(names) != ndim:
        raise EstimatorValueError(
            f"variable {jax.tree_util.keystr(path)} has partition names {names} for a value "
            f"of rank {ndim}"
        )
    entries: list[Any] = []
    used: set[str] = set()
    for name in names:
        parts = name if isinstance(name, tuple) else (name,)
        axes = tuple(rules[n] for n in parts if n is not None and rules.get(n) is not None)
        if used.intersection(axes):
            raise EstimatorValueError(
                f"variable {jax.tree_util.keystr(path)}: partition names {names} map mesh "
                f"axes {axes} to more than one dimension"
            )
        used.update(axes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*entries)


def param_specs(variables: PyTree, *, rules: Rules | None = None) -> PyTree:
    """``PartitionSpec`` of every variable, in the structure of ``unbox(variables)``.

    ``nn.Partitioned`` boxes (``nn.with_partitioning``, ``nn.with_logical_partitioning``) are
    read through ``rules``: a partition name mapped to a mesh axis shards that dimension over
    it; other names and ``None`` leave it whole. Unboxed leaves are replicated (``P()``).

    Args:
      variables: a Flax variables pytree, with arrays or ``jax.ShapeDtypeStruct`` leaves
        (``jax.eval_shape(model.init, ...)`` works).
      rules: partition name -> mesh axis (a mapping or Flax-style pairs); default
        ``{"model": "model"}``.

    Example:
      >>> boxed = {"w": nn.Partitioned(jnp.zeros((4, 6)), names=(None, "model"))}
      >>> param_specs(boxed)
      {'w': PartitionSpec(None, 'model')}
    """
    table = _rules_dict(rules)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _spec_of(path, leaf, table), variables, is_leaf=_is_box
    )


def param_shardings(mesh: Mesh, variables: PyTree, *, rules: Rules | None = None) -> PyTree:
    """``NamedSharding`` on ``mesh`` of every variable (see ``param_specs``).

    Raises:
      ValueError: a sharded dimension is not divisible by its mesh axis size, or a rule
        names an axis ``mesh`` does not have; the message names the variable.
    """
    specs = param_specs(variables, rules=rules)
    shapes = jax.tree.map(lambda a: tuple(getattr(a, "shape", ())), unbox(variables))

    def sharding(path: Any, spec: P, shape: tuple[int, ...]) -> NamedSharding:
        for size, entry in zip(shape, spec, strict=False):
            axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            missing = [a for a in axes if a not in mesh.shape]
            if missing:
                raise EstimatorValueError(
                    f"variable {jax.tree_util.keystr(path)}: mesh has no axis {missing[0]!r}"
                )
            split = math.prod(mesh.shape[a] for a in axes)
            if size % split:
                raise EstimatorValueError(
                    f"variable {jax.tree_util.keystr(path)} of shape {shape} cannot be "
                    f"sharded {spec}: {size} is not divisible by {split}"
                )
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(
        sharding, specs, shapes, is_leaf=lambda x: isinstance(x, P)
    )


def unbox(variables: PyTree) -> PyTree:
    """Strips Flax metadata boxes (``nn.Partitioned``), leaving plain arrays."""
    return meta.unbox(variables)


def shard_variables(mesh: Mesh, variables: PyTree, *, rules: Rules | None = None) -> PyTree:
    """Unboxes ``variables`` and places each on ``mesh`` with its ``param_shardings``.

    Example:
      >>> placed = shard_variables(mesh, model.init(rng, x))   # kernel: P(None, "model")
      >>> placed["params"]["Dense_0"]["kernel"].addressable_shards[0].data.shape
      (64, 256)                                                # of (64, 512) on 2 cores
    """
    return jax.device_put(unbox(variables), param_shardings(mesh, variables, rules=rules))
