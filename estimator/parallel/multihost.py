"""What the loops need when the job spans processes: global arrays, host copies, agreement.

In a one-process job every function here is the plain single-process operation (or returns
its input), so nothing changes and nothing is communicated. With several processes:

* each process reads only its own rows; ``global_batch`` turns them into global arrays;
* ``to_host`` copies a global array to every process (``process_allgather``), where
  ``jax.device_get`` would fail on rows held by another process;
* decisions one process takes alone (stop, save now, input ended, a host function failed)
  are agreed with ``any_of`` (input chunks in ``data/synced.py``) so every process runs the
  same computations in the same order (a process that skipped one would leave the others waiting);
* ``run_on_process_0`` runs host-only work (metric_fn) once and hands every process the
  result.

Every function that communicates must be called by all processes, from the main thread, in
the same order.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from ..core.errors import EstimatorRuntimeError, EstimatorValueError
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
        raise EstimatorValueError(
            f"the device mesh uses processes {sorted(present)} of {jax.process_count()}; in a "
            "many-process job every process must hold replicas (use_tpu=True)"
        )
    if any(len(set(row.tolist())) > 1 for row in owners):
        raise EstimatorValueError(
            f"num_cores_per_replica={mesh.shape['model']} spans processes (each has "
            f"{jax.local_device_count()} devices); a replica must live on one process"
        )
    counts = np.bincount(owners[:, 0], minlength=jax.process_count())
    if len(set(counts.tolist())) != 1:
        raise EstimatorValueError(
            f"processes hold different numbers of replicas: {counts.tolist()}"
        )


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


def truncate_steps(x: jax.Array, n: int) -> jax.Array:
    """The first ``n`` steps of a ``[steps, ...]`` global array (only local shards move)."""
    shards = [s.data[:n] for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays((n, *x.shape[1:]), x.sharding, shards)


# ----------------------------------------------------------------------------- to the host
def to_host(tree: Any) -> Any:
    """Numpy copies of every leaf on every process."""
    if not is_multiprocess():
        return jax.tree.map(_assembled, tree)

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def _assembled(x: Any) -> Any:
    """A fully addressable array as numpy, its shards copied in with one request each.

    What ``jax.device_get`` does, at a third of its host time for an array split over 8
    devices (0.37 vs 0.98 ms for a call's three eval outputs): the loops fetch every call's
    outputs this way, and on CPU that host time competes with the devices.
    """
    if not isinstance(x, jax.Array):
        return x  # None, Python numbers and numpy arrays are already on the host
    if x.is_fully_replicated:
        return np.asarray(x)
    shards = x.addressable_shards
    for s in shards:
        s.data.copy_to_host_async()  # all transfers in flight before the first wait
    out = np.empty(x.shape, x.dtype)
    for s in shards:
        if s.replica_id == 0:
            out[s.index] = np.asarray(s.data)
    return out


def local_to_host(tree: Any, mesh: Mesh) -> Any:
    """This process's rows of ``[n, global_rows, ...]`` arrays, as numpy (no communication)."""
    if not is_multiprocess():
        return jax.tree.map(_assembled, tree)
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
def gather(values: np.ndarray) -> np.ndarray:
    """``[processes, ...]``: every process's ``values``."""
    return np.asarray(multihost_utils.process_allgather(values))


def any_of(*flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed over processes (so all stop, save or fail together)."""
    if not is_multiprocess():
        return tuple(bool(f) for f in flags)
    got = gather(np.array([bool(f) for f in flags], np.int32))
    return tuple(bool(v) for v in got.max(axis=0))


def gather_objects(obj: Any) -> list:
    """Every process's ``obj`` (picklable), in process order."""
    if not is_multiprocess():
        return [obj]
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = gather(np.array([data.size], np.int64)).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = gather(padded)
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


class RemoteError(EstimatorRuntimeError):
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
