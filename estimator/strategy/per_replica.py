"""PerReplica: a value with one entry per replica, as ``TPUStrategy.run`` returns it.

Stored as one global array with a leading replica axis ``(R, *per_replica_shape)`` sharded
over ``"data"`` (or, when replicas' shapes differ, a tuple of arrays).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ..core.errors import EstimatorValueError


@jax.tree_util.register_pytree_node_class
class PerReplica:
    """One value per replica (TF's ``PerReplica``); a pytree node over its arrays.

    Build one from per-replica values, ``PerReplica([v0, v1, ...])``, or from an array whose
    leading axis is the replica axis, ``PerReplica.from_stacked(x)``. ``run`` returns and
    accepts the stacked form.

    Example:
      >>> v = PerReplica.from_stacked(np.arange(6).reshape(3, 2))
      >>> len(v), [a.tolist() for a in v.values]
      (3, [[0, 1], [2, 3], [4, 5]])
    """

    __slots__ = ("_stacked", "_values")

    def __init__(self, values: Sequence[Any]) -> None:
        self._stacked = None
        self._values = tuple(values)

    @classmethod
    def from_stacked(cls, stacked: Any) -> PerReplica:
        """Wraps an array whose axis 0 indexes replicas (a ``run`` output)."""
        obj = object.__new__(cls)
        obj._stacked, obj._values = stacked, None
        return obj

    @property
    def is_stacked(self) -> bool:
        """True for the stacked form (one global array), False for a tuple of arrays."""
        return self._values is None

    @property
    def stacked(self) -> Any:
        """The global array ``(num_replicas, *per_replica_shape)``; ValueError if ragged."""
        if self._values is None:
            return self._stacked
        shapes = {tuple(np.shape(v)) for v in self._values}
        if len(shapes) > 1:
            raise EstimatorValueError(f"per-replica values have different shapes {sorted(shapes)}")
        return np.stack([np.asarray(v) for v in self._values])

    @property
    def values(self) -> tuple[Any, ...]:
        """The per-replica values this process holds, replica 0 first."""
        if self._values is not None:
            return self._values
        return _split_stacked(self._stacked)

    def __len__(self) -> int:
        return len(self._values) if self._values is not None else int(self._stacked.shape[0])

    def __repr__(self) -> str:
        x = self._stacked
        if self._values is None and hasattr(x, "shape") and hasattr(x, "dtype"):
            return f"PerReplica(replicas={x.shape[0]}, shape={tuple(x.shape[1:])}, {x.dtype})"
        if self._values is None:
            return f"PerReplica.from_stacked({x!r})"
        return f"PerReplica({list(self._values)!r})"

    def tree_flatten(self) -> tuple[tuple[Any, ...], bool]:
        if self._values is None:
            return (self._stacked,), True
        return self._values, False

    @classmethod
    def tree_unflatten(cls, stacked: bool, children: Sequence[Any]) -> PerReplica:
        obj = object.__new__(cls)
        if stacked:
            obj._stacked, obj._values = children[0], None
        else:
            obj._stacked, obj._values = None, tuple(children)
        return obj


def _is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


def _split_stacked(x: Any) -> tuple[Any, ...]:
    """Per-replica values of a stacked array, from device-local shards when possible.

    A shard that holds one whole replica's value is used as is (no copy between devices);
    otherwise (values sharded over ``"model"``) the array is indexed.
    """
    if not _is_concrete(x):
        return tuple(x[i] for i in range(x.shape[0]))
    by_replica: dict[int, Any] = {}
    for shard in x.addressable_shards:
        first, rest = shard.index[0], shard.index[1:]
        whole = all(s == slice(None) for s in rest)
        if first.stop is not None and first.stop - (first.start or 0) == 1 and whole:
            by_replica.setdefault(first.start or 0, shard.data)
    if x.is_fully_addressable and len(by_replica) < x.shape[0]:
        return tuple(x[i] for i in range(x.shape[0]))
    return tuple(by_replica[i].reshape(x.shape[1:]) for i in sorted(by_replica))


def _is_concrete(x: Any) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
