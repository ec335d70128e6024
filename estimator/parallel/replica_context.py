"""Replica contexts: cross-replica helpers available inside a replicated computation.

Inside ``TPUStrategy.run`` (and inside the estimator's ``model_fn``) the code runs once per
replica, manual over the ``"data"`` mesh axis. ``get_replica_context()`` returns an object with
the replica id and ``lax``-style collectives over that axis, as ``tf.distribute`` did:

    def step_fn(params, batch):
        ctx = estimator.get_replica_context()
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        grads = ctx.all_reduce(estimator.ReduceOp.MEAN, grads)   # cross-replica mean
        return ctx.all_reduce("mean", loss), grads

Outside any replicated computation it returns a default context for a single replica, whose
collectives are the identity, so the same code also runs un-replicated.

Whoever compiles a replicated computation (``TPUStrategy.run``, the estimator's model_fn
wrapper) pushes a context while *tracing* the per-replica function:

    with replica_scope(num_replicas, axis_name="data"):
        out = model_fn(...)          # traced inside jax.shard_map(..., axis_names={"data"})

``replica_scope(1, axis_name=None)`` marks a compiled computation that is not sharded (the
estimator's ``use_tpu=False`` path): ``in_replicated_computation()`` is then True, but the
collectives are the identity.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator
from typing import Any

import jax
from jax import lax

from ..core.errors import EstimatorValueError
from .mesh import DATA

PyTree = Any


class ReduceOp(enum.Enum):
    """How values from different replicas are combined (``tf.distribute.ReduceOp``).

    Strings are accepted wherever a ``ReduceOp`` is, case-insensitively:

    Example:
      >>> ReduceOp.from_value("mean")
      <ReduceOp.MEAN: 'MEAN'>
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_value(cls, op: ReduceOp | str) -> ReduceOp:
        """Returns ``op`` as a ``ReduceOp``; a ValueError names anything else."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str) and op.upper() in cls.__members__:
            return cls[op.upper()]
        raise EstimatorValueError(f"reduce op must be ReduceOp.SUM or ReduceOp.MEAN, got {op!r}")


def is_varying(x: Any, axis_name: str) -> bool:
    """Whether ``x`` is typed as varying over ``axis_name`` (check_vma tracking)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return axis_name in vma


class ReplicaContext:
    """The current replica's view of a replicated computation.

    Attributes are read at trace time: ``replica_id_in_sync_group`` is a traced int32 scalar
    (``lax.axis_index``) inside a replicated computation and the Python int ``0`` outside.

    Example:
      >>> ctx = get_replica_context()          # outside any replicated computation
      >>> ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group
      (1, 0)
      >>> float(ctx.all_reduce(ReduceOp.SUM, 3.0))
      3.0
    """

    def __init__(
        self,
        num_replicas_in_sync: int = 1,
        *,
        axis_name: str | None = None,
        strategy: Any = None,
    ) -> None:
        if num_replicas_in_sync < 1:
            raise EstimatorValueError(
                f"num_replicas_in_sync must be >= 1, got {num_replicas_in_sync}"
            )
        if axis_name is None and num_replicas_in_sync != 1:
            raise EstimatorValueError(
                f"a context of {num_replicas_in_sync} replicas needs the mesh axis_name "
                "its replicas are laid out on"
            )
        self._num_replicas = int(num_replicas_in_sync)
        self._axis_name = axis_name
        self._strategy = strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas taking part in the computation (static)."""
        return self._num_replicas

    @property
    def axis_name(self) -> str | None:
        """The mesh axis the replicas run over (``"data"``), or None for a single replica."""
        return self._axis_name

    @property
    def strategy(self) -> Any:
        """The strategy running this computation, or None (the estimator, or no strategy)."""
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> Any:
        """This replica's index in ``[0, num_replicas_in_sync)``; replica 0's rows come first."""
        if self._axis_name is None:
            return 0
        return lax.axis_index(self._axis_name)

    def all_reduce(self, reduce_op: ReduceOp | str, value: PyTree, options: Any = None) -> PyTree:
        """Sums or averages every leaf of ``value`` across replicas.

        A value that is the same on every replica (not derived from the replica's inputs)
        sums to ``num_replicas_in_sync`` times itself and averages to itself, as in TF.

        Args:
          reduce_op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN`` (or ``"sum"``/``"mean"``).
          value: a pytree of arrays.
          options: accepted for TF compatibility; ignored.

        Returns:
          The reduced pytree, identical on every replica.
        """
        del options
        op = ReduceOp.from_value(reduce_op)
        if self._axis_name is None:
            return value
        reduce = lax.psum if op is ReduceOp.SUM else lax.pmean
        return jax.tree.map(lambda x: reduce(x, self._axis_name), value)

    def all_gather(self, value: PyTree, axis: int = 0, options: Any = None) -> PyTree:
        """Concatenates every leaf across replicas along ``axis``, replica 0 first.

        Args:
          value: a pytree of arrays of rank >= 1 with the same shape on every replica.
          axis: the axis to concatenate along.
          options: accepted for TF compatibility; ignored.

        Returns:
          A pytree whose leaves are ``num_replicas_in_sync`` times longer along ``axis``.
        """
        del options
        if self._axis_name is None:
            return value
        return jax.tree.map(
            lambda x: lax.all_gather(x, self._axis_name, axis=axis, tiled=True), value
        )

    def vary(self, value: PyTree) -> PyTree:
        """Marks replicated leaves of ``value`` as per-replica (``lax.pcast(to='varying')``).

        Needed before ``jax.grad`` with respect to a replicated parameter inside
        ``jax.shard_map``: without it JAX sums the gradient over replicas by itself and a
        following ``all_reduce(MEAN, ...)`` silently returns ``num_replicas`` times the mean.
        ``TPUStrategy.run`` already does this for every argument it replicates.
        """
        if self._axis_name is None:
            return value
        axis = self._axis_name

        def cast(x: Any) -> Any:
            return x if is_varying(x, axis) else lax.pcast(x, axis, to="varying")

        return jax.tree.map(cast, value)

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(num_replicas_in_sync={self._num_replicas}, "
            f"axis_name={self._axis_name!r})"
        )


_DEFAULT_CONTEXT = ReplicaContext(1)
_STACK: contextvars.ContextVar[tuple[ReplicaContext, ...]] = contextvars.ContextVar(
    "estimator_replica_contexts", default=()
)


@contextlib.contextmanager
def replica_scope(
    num_replicas: int, *, axis_name: str | None = DATA, strategy: Any = None
) -> Iterator[ReplicaContext]:
    """Marks the code traced inside the ``with`` block as one replica of ``num_replicas``.

    Push it around the call of the per-replica function while it is traced inside
    ``jax.shard_map(..., axis_names={axis_name})``.

    Args:
      num_replicas: replicas in sync (the size of ``axis_name`` in the mesh).
      axis_name: the manual mesh axis the replicas run over; None for an unsharded
        computation of one replica.
      strategy: the strategy that owns the computation, if any (``ctx.strategy``).

    Yields:
      The pushed ``ReplicaContext``.
    """
    ctx = ReplicaContext(num_replicas, axis_name=axis_name, strategy=strategy)
    token = _STACK.set(_STACK.get() + (ctx,))
    try:
        yield ctx
    finally:
        _STACK.reset(token)


def get_replica_context() -> ReplicaContext:
    """The innermost replica context, or a default one-replica context outside of one.

    Unlike TF, this never returns None: outside a replicated computation (even inside a
    ``strategy.scope()``) the default context's collectives are the identity.
    """
    stack = _STACK.get()
    return stack[-1] if stack else _DEFAULT_CONTEXT


def in_replicated_computation() -> bool:
    """Whether code is being traced as one replica (inside ``run`` or ``model_fn``)."""
    return bool(_STACK.get())
