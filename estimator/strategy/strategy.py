"""TPUStrategy: TF's custom-training-loop API over the ``("data", "model")`` mesh.

    strategy = estimator.TPUStrategy()                       # every device, 1 core per replica
    dist = strategy.experimental_distribute_dataset(batches)  # global batches, split per replica

    def step_fn(params, batch):                              # runs once per replica
        ctx = estimator.get_replica_context()
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        grads = ctx.all_reduce(estimator.ReduceOp.MEAN, grads)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    for batch in dist:
        params, loss = strategy.run(step_fn, args=(params, batch))
        print(strategy.reduce(estimator.ReduceOp.MEAN, loss))

State is explicit: ``run`` takes pytrees and returns ``fn``'s output structure with a
``PerReplica`` at every leaf. Arguments are of three kinds:

* ``PerReplica`` values (from the distribute methods, or outputs of ``run``) are split: replica
  ``r`` sees value ``r``;
* other arrays (numpy, ``jax.Array``) are given whole to every replica;
* anything else (Python numbers, strings, ...) is a compile-time constant, hashed into the
  cache key, as ``tf.function`` treats Python values.

**Representation.** A ``PerReplica`` holds one global array with a leading replica axis of
size ``num_replicas_in_sync`` sharded over ``"data"``: a distributed global batch of shape
``(B, ...)`` becomes ``(R, B // R, ...)``; a per-replica scalar loss becomes ``(R,)``. Only a
``PerReplica`` built from per-replica values of different shapes (``values_from_function``)
keeps a tuple of arrays; it can be reduced and read but not passed to ``run``.

**Compilation.** ``run`` is ``jax.jit(jax.shard_map(fn, ..., axis_names={"data"}))``: manual
over ``"data"``, the compiler partitions each replica over ``"model"``. It is compiled once per
(fn, argument structure, kinds, constants) and then per shapes/dtypes by ``jax.jit``; pass the
same function object each step (a new lambda per step compiles every step). Arguments given to
every replica are cast to per-replica (``lax.pcast(..., to="varying")``) before ``fn`` sees
them, so ``jax.grad`` inside ``fn`` gives per-replica gradients and
``ctx.all_reduce(MEAN, grads)`` is the true mean (see the README, "The gradient trap").

**Dispatch.** At most ``max_in_flight`` calls of ``run``/``reduce`` (8 on CPU) are queued
before the oldest is waited for: many queued multi-device programs deadlock XLA:CPU's
collectives (with 8 simulated devices, 32 queued all-reduce steps already abort the process).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.errors import EstimatorTypeError, EstimatorValueError
from ..core.input_context import InputContext
from ..parallel import partitioning
from ..parallel.mesh import DATA
from ..parallel.replica_context import ReduceOp, get_replica_context, replica_scope
from .device_assignment import DeviceAssignment
from .numpy_dataset import NumpyDataset
from .per_replica import PerReplica, _is_concrete, _is_per_replica

PyTree = Any
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """What ``experimental_distribute_values_from_function``'s ``value_fn`` is told."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


_STRATEGIES: contextvars.ContextVar[tuple[TPUStrategy, ...]] = contextvars.ContextVar(
    "estimator_strategies", default=()
)


def get_strategy() -> TPUStrategy:
    """The strategy of the innermost ``scope()``; else a default one-device strategy."""
    stack = _STRATEGIES.get()
    return stack[-1] if stack else _default_strategy()


def has_strategy() -> bool:
    """Whether code runs inside some ``strategy.scope()`` (or a ``run``)."""
    return bool(_STRATEGIES.get())


@functools.lru_cache(maxsize=1)
def _default_strategy() -> TPUStrategy:
    return TPUStrategy(device_assignment=DeviceAssignment.build(num_replicas=1))


_REPLICATED = "replicated"
_DISTRIBUTED = "distributed"


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


class TPUStrategy:
    """Synchronous data parallelism over replicas, model parallelism within each.

    Args:
      cluster_resolver: optional; if it has a ``connect()`` method it is called (starting the
        multi-process runtime). Kept as ``self.cluster_resolver``.
      device_assignment: a ``DeviceAssignment``; default every device, one core per replica.
      max_in_flight: how many ``run``/``reduce`` calls may be queued before waiting for the
        oldest. Default 8 on CPU, where about 32 queued collective programs over 8 simulated
        devices deadlock XLA (measured), and 32 on accelerators.

    Example:
      >>> strategy = TPUStrategy(device_assignment=DeviceAssignment.build(computation_shape=2))
      >>> strategy.num_replicas_in_sync        # 8 devices, 2 cores per replica
      4
    """

    def __init__(
        self,
        cluster_resolver: Any = None,
        device_assignment: DeviceAssignment | None = None,
        *,
        max_in_flight: int | None = None,
    ) -> None:
        if cluster_resolver is not None and callable(getattr(cluster_resolver, "connect", None)):
            cluster_resolver.connect()
        self.cluster_resolver = cluster_resolver
        self._assignment = device_assignment or DeviceAssignment.build()
        self._mesh = self._assignment.mesh
        self._cache: dict[Any, Callable[..., Any]] = {}
        self._in_flight: collections.deque[Any] = collections.deque()
        if max_in_flight is None:
            on_cpu = self._mesh.devices.flat[0].platform == "cpu"
            max_in_flight = 8 if on_cpu else 32
        self._max_in_flight = max(1, int(max_in_flight))

    @property
    def mesh(self) -> Mesh:
        """The ``("data", "model")`` mesh of shape ``(replicas, cores_per_replica)``."""
        return self._mesh

    @property
    def device_assignment(self) -> DeviceAssignment:
        return self._assignment

    @property
    def num_replicas_in_sync(self) -> int:
        return self._assignment.num_replicas

    @property
    def num_cores_per_replica(self) -> int:
        return self._assignment.num_cores_per_replica

    @contextlib.contextmanager
    def scope(self) -> Iterator[TPUStrategy]:
        """Makes this the strategy ``get_strategy()`` returns inside the block."""
        token = _STRATEGIES.set(_STRATEGIES.get() + (self,))
        try:
            yield self
        finally:
            _STRATEGIES.reset(token)

    # ----------------------------------------------------------------------------- run

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict | None = None,
        options: Any = None,
    ) -> PyTree:
        """Runs ``fn(*args, **kwargs)`` once per replica, compiled; see the module docstring.

        ``run`` may itself be called inside ``jax.jit`` (e.g. a ``lax.fori_loop`` of steps,
        like a ``tf.function`` looping over ``strategy.run``). ``options`` is accepted for TF
        compatibility and ignored.

        Returns:
          ``fn``'s output structure with a stacked ``PerReplica`` at each array leaf.

        Raises:
          TypeError: a non-array argument is not hashable.
          ValueError: a ``PerReplica`` argument has the wrong number of replicas or is ragged.
        """
        del options
        leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs or {})), _is_per_replica)
        kinds: list[Any] = []
        dynamic: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, PerReplica):
                kinds.append(_DISTRIBUTED)
                dynamic.append(self._to_global(leaf))
            elif _is_array(leaf):
                kinds.append(_REPLICATED)
                dynamic.append(self._to_mesh(leaf))
            else:
                kinds.append(("constant", leaf))
        key = (fn, treedef, tuple(kinds))
        try:
            compiled = self._cache.get(key)
        except TypeError as e:
            bad = [k[1] for k in kinds if isinstance(k, tuple) and not _hashable(k[1])]
            raise EstimatorTypeError(
                f"non-array arguments of run are compile-time constants and must be "
                f"hashable; got {bad[0]!r:.80}"
            ) from e
        if compiled is None:
            compiled = self._cache[key] = self._compile(fn, treedef, tuple(kinds))
        out = compiled(*dynamic)
        self._track(out)
        return jax.tree.map(PerReplica.from_stacked, out)

    def _compile(self, fn: Callable[..., Any], treedef: Any, kinds: tuple[Any, ...]):
        num_replicas = self.num_replicas_in_sync

        def per_replica(*dynamic: Any) -> Any:
            it = iter(dynamic)
            leaves = []
            for kind in kinds:
                if kind == _DISTRIBUTED:
                    leaves.append(next(it)[0])
                elif kind == _REPLICATED:
                    # Per-replica from here on, so that jax.grad gives per-replica gradients.
                    leaves.append(lax.pcast(next(it), DATA, to="varying"))
                else:
                    leaves.append(kind[1])
            args, kwargs = jax.tree.unflatten(treedef, leaves)
            with self.scope(), replica_scope(num_replicas, axis_name=DATA, strategy=self):
                out = fn(*args, **kwargs)
            return jax.tree.map(lambda y: jnp.expand_dims(jnp.asarray(y), 0), out)

        in_specs = tuple(P(DATA) if k == _DISTRIBUTED else P() for k in kinds if isinstance(k, str))
        mapped = jax.shard_map(
            per_replica, mesh=self._mesh, in_specs=in_specs, out_specs=P(DATA), axis_names={DATA}
        )
        return jax.jit(mapped)

    def _to_mesh(self, x: Any) -> Any:
        """Replicates a jax.Array living elsewhere (e.g. committed to one device)."""
        if _is_concrete(x) and x.sharding.device_set != self._mesh_devices:
            return jax.device_put(x, NamedSharding(self._mesh, P()))
        return x

    @functools.cached_property
    def _mesh_devices(self) -> set[jax.Device]:
        return set(self._mesh.devices.flat)

    def _to_global(self, value: PerReplica) -> Any:
        """The stacked global array of ``value``, placed over ``"data"``."""
        if not value.is_stacked:
            local = len(self._assignment.lookup_replicas())
            if len(value) != local:
                raise EstimatorValueError(
                    f"a PerReplica of {len(value)} values was given to a strategy with "
                    f"{local} local replicas"
                )
            value = self._from_per_replica_values(list(value.values), what="a PerReplica")
            if not value.is_stacked:
                raise EstimatorValueError(
                    "a PerReplica whose values have different shapes cannot be passed to run"
                )
        x = value.stacked
        if np.ndim(x) == 0 or x.shape[0] != self.num_replicas_in_sync:
            raise EstimatorValueError(
                f"a PerReplica of {len(value)} replicas was given to a strategy with "
                f"{self.num_replicas_in_sync} replicas"
            )
        if isinstance(x, jax.core.Tracer) or (
            _is_concrete(x) and x.sharding.device_set == self._mesh_devices
        ):
            return x
        x = np.asarray(x)
        sharding = NamedSharding(self._mesh, P(DATA))
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def _track(self, out: Any) -> None:
        """Bounds queued multi-device programs by waiting on the oldest one's smallest output."""
        leaves = [x for x in jax.tree.leaves(out) if _is_concrete(x)]
        if not leaves:
            return  # nothing to wait on, or traced inside the caller's jax.jit
        self._in_flight.append(min(leaves, key=lambda a: a.size))
        while len(self._in_flight) > self._max_in_flight:
            self._in_flight.popleft().block_until_ready()

    # -------------------------------------------------------------------------- reduce

    def reduce(self, reduce_op: ReduceOp | str, value: PyTree, axis: int | None = None) -> PyTree:
        """Reduces per-replica values across replicas (and along ``axis``), as TF does.

        For each leaf: a ``PerReplica`` is summed/averaged over replicas; with ``axis`` also
        along that axis of each replica's value, and ``MEAN`` divides by the total count of
        elements along ``axis`` over all replicas (so uneven per-replica sizes average
        correctly). A plain array is the same value on every replica: with ``axis=None``,
        ``MEAN`` returns it and ``SUM`` is a ValueError (TF's rule); with ``axis`` it is
        reduced as if each replica held it.

        Args:
          reduce_op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN``.
          value: a pytree of ``PerReplica`` values and arrays (a ``run`` output).
          axis: None, or an axis of the per-replica values.

        Returns:
          ``value``'s structure with a plain array at each leaf.
        """
        op = ReduceOp.from_value(reduce_op)
        return jax.tree.map(
            lambda v: self._reduce_leaf(op, v, axis), value, is_leaf=_is_per_replica
        )

    def _reduce_leaf(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        n = self.num_replicas_in_sync
        if not isinstance(value, PerReplica):
            if axis is None:
                if op is ReduceOp.SUM and n > 1:
                    raise EstimatorValueError(
                        f"a non-distributed value cannot be reduced with SUM over {n} replicas "
                        "(it is the same on every replica); pass a PerReplica or use MEAN"
                    )
                return value
            x = jnp.asarray(value)
            total = jnp.sum(x, axis=axis)
            return total * n if op is ReduceOp.SUM else total / x.shape[axis]
        if value.is_stacked:
            x = value.stacked
            axes = (0,) if axis is None else (0, 1 + _normalize_axis(axis, np.ndim(x) - 1))
            out = _reduce_stacked(x, op=op.value, axes=axes, mesh=_mesh_of(x))
            self._track(out)
            return out
        parts = [jnp.asarray(v) for v in value.values]
        if axis is None:
            if len({v.shape for v in parts}) > 1:
                raise EstimatorValueError(
                    "per-replica values of different shapes "
                    f"{[v.shape for v in parts]} can only be reduced along an axis"
                )
            parts = [jax.device_put(v, jax.devices()[0]) for v in parts]
            total = functools.reduce(jnp.add, parts)
            return total if op is ReduceOp.SUM else total / len(parts)
        sums = [np.asarray(jnp.sum(v, axis=axis)) for v in parts]
        total = functools.reduce(np.add, sums)
        count = sum(v.shape[_normalize_axis(axis, v.ndim)] for v in parts)
        return jnp.asarray(total if op is ReduceOp.SUM else total / count)

    def gather(self, value: PyTree, axis: int) -> PyTree:
        """Concatenates per-replica values along ``axis``, replica 0 first (TF's ``gather``).

        Plain (non-distributed) leaves are returned unchanged. A batch split by
        ``experimental_distribute_dataset`` gathers back to the global batch with ``axis=0``.
        """

        def leaf(v: Any) -> Any:
            if not isinstance(v, PerReplica):
                return v
            if not v.is_stacked:
                parts = [np.asarray(p) for p in v.values]
                return jnp.asarray(np.concatenate(parts, axis=axis))
            x = v.stacked
            k = _normalize_axis(axis, np.ndim(x) - 1)
            out = _concat_stacked(x, axis=k, mesh=_mesh_of(x))
            self._track(out)
            return out

        return jax.tree.map(leaf, value, is_leaf=_is_per_replica)

    # -------------------------------------------------------------------- distributing

    def experimental_distribute_dataset(self, dataset: Iterable[Any], options: Any = None):
        """Splits each global batch of ``dataset`` over replicas along axis 0.

        Args:
          dataset: an iterable of pytrees of arrays, each leaf of shape ``(B, ...)`` with ``B``
            the global batch size, divisible by ``num_replicas_in_sync``.
          options: accepted for TF compatibility; ignored.

        Returns:
          A re-iterable ``DistributedDataset`` of pytrees with ``PerReplica`` leaves of
          stacked shape ``(R, B // R, ...)``.
        """
        del options
        return DistributedDataset(lambda: map(self._split_global_batch, dataset))

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: Any = None
    ):
        """Calls ``dataset_fn`` once for this process's input pipeline; batches are per replica.

        ``dataset_fn(InputContext(num_input_pipelines=process count, input_pipeline_id=process
        index, num_replicas_in_sync=R))`` returns an iterable of per-replica batches (use
        ``ctx.get_per_replica_batch_size(global_batch)``). Each step pulls one batch per local
        replica, in replica order, as TF does. An incomplete final step is dropped, with a
        warning.
        """
        del options
        ctx = InputContext(
            num_input_pipelines=jax.process_count(),
            input_pipeline_id=jax.process_index(),
            num_replicas_in_sync=self.num_replicas_in_sync,
        )
        dataset = dataset_fn(ctx)
        local = len(self._assignment.lookup_replicas())
        return DistributedDataset(lambda: self._per_replica_steps(iter(dataset), local))

    def experimental_distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: Any = None
    ):
        """TF 2.3's name of ``distribute_datasets_from_function`` (the same method)."""
        return self.distribute_datasets_from_function(dataset_fn, options)

    def experimental_make_numpy_dataset(self, numpy_input: Any, session: Any = None):
        """A dataset of the examples of ``numpy_input`` (a pytree of arrays sliced along
        axis 0), as TF's ``from_tensor_slices`` on the host; ``session`` is ignored.

        Batch it with ``.batch(global_batch_size)`` and distribute it with
        ``experimental_distribute_dataset``.
        """
        del session
        return NumpyDataset.from_tensor_slices(numpy_input)

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> PyTree:
        """Calls ``value_fn(ValueContext(replica_id, R))`` for each local replica.

        Returns:
          The common structure of the values with a ``PerReplica`` at each leaf: stacked
          when the replicas' values have the same shape, else a tuple (ragged; it can be
          reduced and read but not passed to ``run``).
        """
        n = self.num_replicas_in_sync
        values = [value_fn(ValueContext(i, n)) for i in self._assignment.lookup_replicas()]
        return self._from_per_replica_values(values, what="value_fn")

    def experimental_local_results(self, value: PyTree) -> tuple[Any, ...]:
        """The values of this process's replicas: one structure per replica, replica 0 first.

        A ``PerReplica`` gives its values; a structure of them gives one structure per
        replica; a plain value gives ``(value,)``.
        """
        leaves, treedef = jax.tree.flatten(value, is_leaf=_is_per_replica)
        if not any(isinstance(x, PerReplica) for x in leaves):
            return (value,)
        per_leaf = [x.values if isinstance(x, PerReplica) else None for x in leaves]
        count = max(len(v) for v in per_leaf if v is not None)
        return tuple(
            jax.tree.unflatten(
                treedef, [x if v is None else v[i] for x, v in zip(leaves, per_leaf, strict=True)]
            )
            for i in range(count)
        )

    def _split_global_batch(self, batch: PyTree) -> PyTree:
        n = self.num_replicas_in_sync
        sharding = NamedSharding(self._mesh, P(DATA))

        def split(path: Any, leaf: Any) -> PerReplica:
            x = np.asarray(leaf)
            if x.ndim == 0 or x.shape[0] % n:
                raise EstimatorValueError(
                    f"batch element {jax.tree_util.keystr(path) or '<root>'} has shape "
                    f"{x.shape}: its leading (batch) dimension must be divisible by "
                    f"num_replicas_in_sync={n}"
                )
            x = x.reshape((n, x.shape[0] // n) + x.shape[1:])
            return PerReplica.from_stacked(
                jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
            )

        return jax.tree_util.tree_map_with_path(split, batch)

    def _per_replica_steps(self, iterator: Iterator[Any], local: int) -> Iterator[PyTree]:
        while True:
            batches = []
            for _ in range(local):
                try:
                    batches.append(next(iterator))
                except StopIteration:
                    if batches:
                        _log.warning(
                            "dropping an incomplete final step: %d of %d per-replica batches",
                            len(batches),
                            local,
                        )
                    return
            yield self._from_per_replica_values(batches, what="dataset_fn's dataset")

    def _from_per_replica_values(self, values: list[Any], *, what: str) -> PyTree:
        """Stacks this process's per-replica structures into a structure of PerReplica."""
        treedef = jax.tree.structure(values[0])
        flat = []
        for i, v in enumerate(values):
            if jax.tree.structure(v) != treedef:
                raise EstimatorValueError(
                    f"{what}: replica {i}'s value has structure {jax.tree.structure(v)}, "
                    f"replica 0's has {treedef}"
                )
            flat.append([np.asarray(x) for x in jax.tree.leaves(v)])
        n = self.num_replicas_in_sync
        sharding = NamedSharding(self._mesh, P(DATA))
        leaves = []
        for column in zip(*flat, strict=True):
            if len({x.shape for x in column}) > 1 or len({x.dtype for x in column}) > 1:
                leaves.append(PerReplica(column))
                continue
            local = np.stack(column)
            leaves.append(
                PerReplica.from_stacked(
                    jax.make_array_from_process_local_data(sharding, local, (n,) + local.shape[1:])
                )
            )
        return jax.tree.unflatten(treedef, leaves)

    # ---------------------------------------------------------- logical-device annotations

    def experimental_split_to_logical_devices(
        self, tensor: jax.Array, partition_dimensions: Sequence[int]
    ) -> jax.Array:
        """Shards ``tensor`` over the replica's cores (see ``partitioning``).

        Meant for ``fn`` inside ``run``; outside it constrains the whole array on the mesh.
        """
        return partitioning.split_to_logical_devices(
            tensor,
            partition_dimensions,
            num_cores_per_replica=self.num_cores_per_replica,
            mesh=self._outside_mesh(),
        )

    def experimental_replicate_to_logical_devices(self, tensor: PyTree) -> PyTree:
        """Keeps ``tensor`` whole on every core of the replica; inside ``run``."""
        return partitioning.replicate_to_logical_devices(tensor, mesh=self._outside_mesh())

    def experimental_assign_to_logical_device(
        self, tensor: PyTree, logical_device_id: int
    ) -> PyTree:
        """Validates ``logical_device_id``; the value is replicated (JAX cannot pin one core)."""
        return partitioning.assign_to_logical_device(
            tensor,
            logical_device_id,
            num_cores_per_replica=self.num_cores_per_replica,
            mesh=self._outside_mesh(),
        )

    def _outside_mesh(self) -> Mesh | None:
        # A bare PartitionSpec inside shard_map; this strategy's mesh everywhere else.
        return None if get_replica_context().axis_name is not None else self._mesh


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise EstimatorValueError(
            f"axis {axis} is out of range for per-replica values of rank {ndim}"
        )
    return axis % ndim


@functools.partial(jax.jit, static_argnames=("op", "axes", "mesh"))
def _reduce_stacked(
    x: jax.Array, *, op: str, axes: tuple[int, ...], mesh: Mesh | None
) -> jax.Array:
    out = jnp.sum(x, axis=axes) if op == "SUM" else jnp.mean(x, axis=axes)
    return _replicated_on(out, mesh)


@functools.partial(jax.jit, static_argnames=("axis", "mesh"))
def _concat_stacked(x: jax.Array, *, axis: int, mesh: Mesh | None) -> jax.Array:
    moved = jnp.moveaxis(x, 0, axis)  # (..., replicas, n_axis, ...)
    shape = moved.shape[:axis] + (moved.shape[axis] * moved.shape[axis + 1],)
    return _replicated_on(moved.reshape(shape + moved.shape[axis + 2 :]), mesh)


def _mesh_of(x: Any) -> Mesh | None:
    return x.sharding.mesh if _is_concrete(x) and isinstance(x.sharding, NamedSharding) else None


def _replicated_on(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    # Replicated results can be read by every process (multi-host).
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


class DistributedDataset:
    """An iterable of distributed batches (pytrees with ``PerReplica`` leaves).

    Re-iterable when the underlying dataset is (each ``iter`` starts it again).
    """

    def __init__(self, make_iterator: Callable[[], Iterator[PyTree]]) -> None:
        self._make_iterator = make_iterator

    def __iter__(self) -> Iterator[PyTree]:
        return iter(self._make_iterator())
