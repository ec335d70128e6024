"""What the loops need when the job spans processes: global arrays, host copies, agreement.

In a one-process job every function here is the plain single-process operation (or returns
its input), so nothing changes and nothing is communicated. With several processes:

* each process reads only its own rows; ``global_batch`` turns them into global arrays;
* ``to_host`` copies a global array to every process (``process_allgather``), where
  ``jax.device_get`` would fail on rows held by another process;
* decisions one process takes alone (stop, save now, input ended, a host function failed)
  are agreed with ``any_of``/``agree_chunk`` so every process runs the same computations in
  the same order (a process that skipped one would leave the others waiting);
* ``run_on_process_0`` runs host-only work (metric_fn) once and hands every process the
  result.

Every function that communicates must be called by all processes, from the main thread, in
the same order.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from .mesh import DATA


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_process_0() -> bool:
    return jax.process_index() == 0


# ----------------------------------------------------------------------------- the mesh
def check_mesh(mesh: Mesh) -> None:
    """Every process must feed whole replicas of the mesh, the same number each.

    Raises:
      ValueError: the mesh leaves out a process's devices (``use_tpu=False``), or a replica
        spans processes (``num_cores_per_replica`` larger than a process's devices).
    """
    if not is_multiprocess():
        return
    owners = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    present = set(owners.ravel().tolist())
    if present != set(range(jax.process_count())):
        raise ValueError(
            f"the device mesh uses processes {sorted(present)} of {jax.process_count()}; in a "
            "many-process job every process must hold replicas (use_tpu=True)"
        )
    if any(len(set(row.tolist())) > 1 for row in owners):
        raise ValueError(
            f"num_cores_per_replica={mesh.shape['model']} spans processes (each has "
            f"{jax.local_device_count()} devices); a replica must live on one process"
        )
    counts = np.bincount(owners[:, 0], minlength=jax.process_count())
    if len(set(counts.tolist())) != 1:
        raise ValueError(f"processes hold different numbers of replicas: {counts.tolist()}")


def local_replicas(mesh: Mesh) -> int:
    """Replicas whose devices are on this process."""
    me = jax.process_index()
    return sum(any(d.process_index == me for d in row) for row in mesh.devices)


# ----------------------------------------------------------------------------- to devices
def global_batch(tree: Any, mesh: Mesh) -> Any:
    """Local ``[n, local_rows, ...]`` numpy leaves -> global arrays sharded over ``"data"``.

    Each process passes its own rows; process p's rows land on p's replicas, so the global
    batch is process 0's rows, then process 1's, ... (the device order of the mesh).
    """
    sharding = NamedSharding(mesh, jax.sharding.PartitionSpec(None, DATA))
    if not is_multiprocess():
        return jax.device_put(tree, sharding)
    procs = jax.process_count()

    def one(x):
        shape = (x.shape[0], x.shape[1] * procs, *x.shape[2:])
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return jax.tree.map(one, tree)


def _truncate(x: jax.Array, n: int) -> jax.Array:
    """The first ``n`` steps of a ``[steps, ...]`` global array (only local shards move)."""
    shards = [s.data[:n] for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays((n, *x.shape[1:]), x.sharding, shards)


# ----------------------------------------------------------------------------- to the host
def to_host(tree: Any) -> Any:
    """Numpy copies of every leaf on every process (``jax.device_get`` in one process)."""
    if not is_multiprocess():
        return jax.device_get(tree)

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def local_to_host(tree: Any, mesh: Mesh) -> Any:
    """This process's rows of ``[n, global_rows, ...]`` arrays, as numpy (no communication)."""
    if not is_multiprocess():
        return jax.device_get(tree)
    spec = jax.sharding.PartitionSpec(None, DATA)
    local = multihost_utils.global_array_to_host_local_array(tree, mesh, spec)
    return jax.tree.map(np.asarray, local)


def local_rows(x: np.ndarray, mesh: Mesh) -> np.ndarray:
    """This process's rows (axis 1) of a host copy of a global ``[n, rows, ...]`` array."""
    if not is_multiprocess():
        return x
    sharding = NamedSharding(mesh, jax.sharding.PartitionSpec(None, DATA))
    index_map = sharding.addressable_devices_indices_map(x.shape)
    starts = sorted({idx[1].indices(x.shape[1])[:2] for idx in index_map.values()})
    return np.concatenate([x[:, a:b] for a, b in starts], axis=1)


# ----------------------------------------------------------------------------- agreement
def _gather(values: np.ndarray) -> np.ndarray:
    """``[processes, ...]``: every process's ``values``."""
    return np.asarray(multihost_utils.process_allgather(values))


def any_of(*flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed over processes (so all stop, save or fail together)."""
    if not is_multiprocess():
        return tuple(bool(f) for f in flags)
    got = _gather(np.array([bool(f) for f in flags], np.int32))
    return tuple(bool(v) for v in got.max(axis=0))


def gather_objects(obj: Any) -> list:
    """Every process's ``obj`` (picklable), in process order."""
    if not is_multiprocess():
        return [obj]
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = _gather(np.array([data.size], np.int64)).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = _gather(padded)
    return [pickle.loads(rows[i, : sizes[i]].tobytes()) for i in range(len(sizes))]


def broadcast_object(obj: Any) -> Any:
    """Process 0's ``obj`` on every process (other processes may pass anything)."""
    if not is_multiprocess():
        return obj
    data = np.frombuffer(pickle.dumps(obj if is_process_0() else None), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.array(data.size, np.int64)))
    buf = np.zeros(size, np.uint8)
    if is_process_0():
        buf[:] = data
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return pickle.loads(buf.tobytes())


class RemoteError(RuntimeError):
    """Host work that runs on process 0 only failed there; raised on the other processes."""


def run_on_process_0(fn: Callable[[], Any], what: str) -> Any:
    """Runs ``fn`` on process 0 and returns its result on every process.

    An error on process 0 is raised there with its traceback, and as ``RemoteError`` (naming
    ``what`` and the error) on the others, so no process waits for a result that never comes.
    """
    if not is_multiprocess():
        return fn()
    error, payload = None, None
    if is_process_0():
        try:
            payload = ("ok", fn())
        except BaseException as e:  # noqa: BLE001 - re-raised below, on every process
            error, payload = e, ("error", f"{type(e).__name__}: {e}")
    status, value = broadcast_object(payload)
    if error is not None:
        raise error
    if status == "error":
        raise RemoteError(f"{what} failed on process 0: {value}")
    return value


def check_worker(worker: Any, what: str, *, join: bool = False) -> None:
    """``worker.check()`` (or ``join()``) agreed over processes: a host function that failed
    on process 0 stops every process, the others with ``RemoteError``."""
    if not is_multiprocess():
        worker.join() if join else worker.check()
        return
    error = None
    try:
        worker.join() if join else worker.check()
    except BaseException as e:  # noqa: BLE001 - raised below once every process knows
        error = e
    (failed,) = any_of(error is not None or worker.failed)
    if error is not None:
        raise error
    if failed:
        raise RemoteError(f"{what} failed on another process; see its log")


# ----------------------------------------------------------------------------- input
class SyncedChunks:
    """The prefetcher's chunks, agreed across processes so all run the same loops.

    Each process's input may end at a different point. For evaluation and prediction
    (``fill=True``) the loops go on while any process has rows; a process whose input ended
    contributes all-padding steps. For training the loop length is the shortest process's,
    and training ends when any input ends. The host mask becomes the global one, matching
    the global arrays the loops return.
    """

    def __init__(self, prefetch: Any, pipe: Any, *, fill: bool, mesh: Mesh):
        self._prefetch, self._pipe, self._fill, self._mesh = prefetch, pipe, fill, mesh
        self._ended = False

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        chunk = None if self._ended else next(self._prefetch, None)
        self._ended = chunk is None
        local = [0, 0] if chunk is None else [chunk.steps, int(chunk.host_mask.shape[0])]
        table = _gather(np.array(local, np.int64))  # [processes, (real steps, loop length)]
        steps, length = table[:, 0], table[:, 1]
        if self._fill:
            if not steps.max():
                raise StopIteration
            if chunk is None:
                chunk = self._empty_chunk(int(length.max()))
            chunk = chunk._replace(steps=int(steps.max()))
        else:
            n = int(steps.min())
            if n == 0:
                self._ended = True
                raise StopIteration
            if chunk.steps > n:
                chunk = chunk._replace(
                    features=jax.tree.map(lambda x: _truncate(x, n), chunk.features),
                    labels=jax.tree.map(lambda x: _truncate(x, n), chunk.labels),
                    mask=_truncate(chunk.mask, n),
                    host_mask=chunk.host_mask[:n],
                    steps=n,
                )
        return chunk._replace(host_mask=to_host(chunk.mask) > 0)

    def _empty_chunk(self, n: int):
        pipe = self._pipe
        if pipe.sig is None:
            raise ValueError(
                f"input_fn of process {jax.process_index()} produced no batches while other "
                "processes' did; every process needs at least one batch to know the shapes"
            )
        steps = [pipe.empty_step() for _ in range(n)]
        leaves = [np.stack(xs) for xs in zip(*(s[0] for s in steps), strict=True)]
        host_mask = np.stack([s[1] for s in steps])
        features, labels = jax.tree.unflatten(pipe.sig.treedef, leaves)
        features, labels, mask = global_batch(
            (features, labels, host_mask.astype(np.float32)), self._mesh
        )
        from ..data.inputs import Chunk

        return Chunk(features, labels, mask, host_mask, 0, 0, pipe.get_state())

    def close(self) -> None:
        self._prefetch.close()


def synced(prefetch: Any, pipe: Any, *, fill: bool, mesh: Mesh) -> Any:
    """``prefetch`` itself in one process, else a ``SyncedChunks`` over it."""
    if not is_multiprocess():
        return prefetch
    return SyncedChunks(prefetch, pipe, fill=fill, mesh=mesh)
