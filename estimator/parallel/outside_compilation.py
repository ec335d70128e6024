"""outside_compilation: run a host (numpy) function from inside a replicated computation.

Inside ``model_fn`` (called by the estimator) or ``TPUStrategy.run``, the function runs on the
host CPU once per replica per step, with numpy arguments (this replica's rows), and its
result comes back into the device computation. Outside a replicated computation it is simply
called.

Example:
  >>> def parse(x):                                   # plain Python/numpy on the host
  ...     return np.float32(float("1{}".format(int(x))))
  >>> def model_fn(features, labels, mode, params):
  ...     y = estimator.outside_compilation(parse, jnp.int32(1))     # y == 11.0 on device
  ...     estimator.outside_compilation(print_norm, logits, result_shape=None)  # no result
  ...     ...

Result shapes. The device program must know the shape of what the host returns:

* ``result_shape=`` (keyword-only, reserved: it is not passed on to ``computation``) gives it
  as a pytree of ``jax.ShapeDtypeStruct`` (or arrays, whose shape and dtype are used), or
  ``None`` when the computation returns nothing (summaries, logging): then nothing is
  returned and the computation is never called at trace time.
* Without it, the shape is **inferred by calling the computation once at trace time on zero
  arrays** of the arguments' per-replica shapes and dtypes (a "dry run"; its result is thrown
  away). The result is remembered per function (code, closure, non-array arguments) and
  argument shapes, so later traces (the eval loop after init, a second program) call it
  no more. A computation with side effects, or one that fails on zeros, should declare
  ``result_shape``; when the dry run raises, a ValueError says so.

Threads and calls. XLA calls the host function from several threads (one per device);
calls are **serialised** here with one lock, so the function need not be thread-safe, but
the order across replicas is arbitrary (per replica, steps come in order); it must not wait
on a device computation (XLA is waiting for it). Each call sees
this replica's arrays, as numpy. A host function runs once per replica per real step of a
compiled loop: not while the estimator initialises variables or traces model_fn (the
result is zeros there; only an undeclared shape's single dry run calls it), and in EVAL and
PREDICT not on a replica whose rows in that step are all padding (zeros there too). Errors
raised by the host function fail the device computation
(``XlaRuntimeError`` carrying the original message).

Gradients do not flow through a host computation: its result is a constant for ``jax.grad``
(zero gradient to its arguments), so it can be used in TRAIN-mode ``model_fn``.

A computation containing outside_compilation cannot be exported with ``jax.export`` (host
callbacks are not serializable); ``export_saved_model`` raises a clear error.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from jax.sharding import PartitionSpec as P

from ..core import context
from ..core.errors import EstimatorRuntimeError, EstimatorTypeError, EstimatorValueError
from .mesh import DATA
from .replica_context import get_replica_context, in_replicated_computation

PyTree = Any


class _Infer:
    def __repr__(self) -> str:
        return "<infer by a dry run>"


INFER = _Infer()
_HOST_LOCK = threading.RLock()
_LOCAL = threading.local()


@contextlib.contextmanager
def forbid_host_calls(reason: str) -> Iterator[None]:
    """While active (on this thread), outside_compilation raises a RuntimeError with ``reason``.

    Used by export: a host callback cannot be serialized with ``jax.export``.
    """
    prev = getattr(_LOCAL, "forbidden", None)
    _LOCAL.forbidden = reason
    try:
        yield
    finally:
        _LOCAL.forbidden = prev


def in_replicated_context() -> bool:
    """Whether code is being traced as one replica (``TPUStrategy.run`` or the estimator)."""
    return in_replicated_computation() or context.current() is not None


def _axis_name() -> str | None:
    if in_replicated_computation():
        return get_replica_context().axis_name
    return DATA


def _initializing() -> bool:
    """Whether the estimator traces model_fn only to create variables: no host calls then."""
    ctx = context.current()
    return ctx is not None and ctx.initializing


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _struct(x: Any, where: str) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, jax.dtypes.canonicalize_dtype(x.dtype))
    try:
        arr = np.asarray(x)
    except Exception as e:  # noqa: BLE001
        raise EstimatorTypeError(f"{where}: {x!r} is not an array or jax.ShapeDtypeStruct") from e
    if arr.dtype.kind in "OUSV":
        raise EstimatorTypeError(f"{where}: {x!r} is not a numeric array (dtype {arr.dtype})")
    return jax.ShapeDtypeStruct(arr.shape, jax.dtypes.canonicalize_dtype(arr.dtype))


def _structs(tree: PyTree, where: str) -> PyTree:
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [_struct(x, f"{where}{jax.tree_util.keystr(p)}") for p, x in paths]
    return jax.tree.unflatten(treedef, leaves)


def _name(computation: Callable) -> str:
    return getattr(computation, "__qualname__", None) or repr(computation)


_INFERRED: dict = {}  # result shapes found by dry runs: one per function and argument shapes


def _shape_key(computation: Callable, leaves: list, is_array: list, arrays: list) -> Any:
    """What the dry run's result shape depends on: the function (its code, what it closes
    over, its ``self``), the non-array arguments and the arrays' shapes and dtypes. None when
    something is unhashable (then every trace runs its own dry run)."""

    def ident(x: Any) -> Any:
        try:
            hash(x)
        except TypeError:
            return ("id", id(x))
        return x

    code = getattr(computation, "__code__", None)
    if code is None:
        fn = ident(computation)
    else:
        cells = getattr(computation, "__closure__", None) or ()
        closure = []
        for cell in cells:
            try:
                closure.append(ident(cell.cell_contents))
            except ValueError:  # an empty cell
                closure.append(None)
        fn = (code, tuple(closure), id(getattr(computation, "__self__", None)))
    static = tuple(ident(x) for x, a in zip(leaves, is_array, strict=True) if not a)
    shapes = tuple((tuple(a.shape), str(a.dtype)) for a in arrays)
    key = (fn, static, shapes)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _dry_run(computation: Callable, rebuild: Callable, arrays: list) -> PyTree:
    zeros = [np.zeros(a.shape, jax.dtypes.canonicalize_dtype(a.dtype)) for a in arrays]
    args, kwargs = rebuild(zeros)
    try:
        with _HOST_LOCK:
            out = computation(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised with what to do about it
        shapes = [f"{z.dtype}{list(z.shape)}" for z in zeros]
        raise EstimatorValueError(
            f"outside_compilation could not infer the result shape of {_name(computation)}: "
            f"calling it once on zero arrays {shapes} raised {type(e).__name__}: {e}. Pass "
            "result_shape=... (a pytree of jax.ShapeDtypeStruct, or None when it returns "
            "nothing)"
        ) from e
    if out is None:
        return None
    return _structs(out, "the result of the outside_compilation dry run")


def _to_host(expected: PyTree, name: str) -> Callable[[Any], list]:
    """Converts what the host function returned to numpy leaves of the declared shapes."""
    treedef = jax.tree.structure(expected)
    specs = jax.tree.leaves(expected)

    def convert(out: Any) -> list:
        got = jax.tree.structure(out)
        if got != treedef:
            raise EstimatorValueError(
                f"outside_compilation {name} returned a result of structure {got}, but "
                f"result_shape declares {treedef}"
            )
        leaves = []
        for i, (x, spec) in enumerate(zip(jax.tree.leaves(out), specs, strict=True)):
            arr = np.asarray(x)
            if arr.shape != tuple(spec.shape):
                raise EstimatorValueError(
                    f"outside_compilation {name} returned shape {arr.shape} for result leaf "
                    f"{i}, but result_shape declares {tuple(spec.shape)}"
                )
            leaves.append(arr.astype(spec.dtype, copy=False))
        return leaves

    return convert


def _host_call(computation: Callable, rebuild: Callable, arrays: list, expected: PyTree) -> PyTree:
    """The io_callback itself, typed per replica and transparent (zero) to gradients.

    In EVAL and PREDICT a replica whose rows in this step are all padding skips the call
    (its result is zeros): the host function runs only on real steps.
    """
    name = _name(computation)
    convert = _to_host(expected, name) if expected is not None else None
    specs = None if expected is None else jax.tree.leaves(expected)

    def host(*values):
        args, kwargs = rebuild([np.asarray(v) for v in values])
        with _HOST_LOCK:
            out = computation(*args, **kwargs)
        return None if convert is None else convert(out)

    def callback(*values):
        return io_callback(host, specs, *values, ordered=False)

    real = _has_real_rows()

    @jax.custom_jvp
    def call(*values):
        if real is None:
            return _on_first_core(callback, specs, values)
        return _on_first_core(lambda r, *v: _when(r, callback, v, specs), specs, (real, *values))

    @call.defjvp
    def call_jvp(primals, tangents):
        out = call(*primals)
        if out is None:
            return None, None
        return out, [_zero_tangent(o) for o in out]

    out = call(*arrays)
    if out is None:
        return None
    out = [_per_replica(o) for o in out]
    return jax.tree.unflatten(jax.tree.structure(expected), out)


def _has_real_rows() -> jax.Array | None:
    """In EVAL/PREDICT inside model_fn: whether this replica's batch has a real row (a
    traced bool); None where every row is real (training, or outside the estimator)."""
    ctx = context.current()
    if ctx is None or ctx.mask is None or ctx.mode == "train" or ctx.initializing:
        return None
    return jnp.any(ctx.mask > 0)


def _when(real: jax.Array, callback: Callable, values: tuple, specs: list | None) -> Any:
    """``callback(*values)`` on a replica with real rows; zeros (no call) on padding."""
    if specs is None:
        lax.cond(real, lambda: callback(*values), lambda: None)
        return None
    zeros = [jnp.zeros(s.shape, s.dtype) for s in specs]
    outs = lax.cond(real, lambda: list(callback(*values)), lambda: zeros)
    return outs


def _auto_axes() -> tuple[str, ...]:
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.axis_names:
        return ()
    return tuple(
        n
        for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t != jax.sharding.AxisType.Manual
    )


def _on_first_core(fn: Callable, specs: list | None, values: tuple) -> Any:
    """Calls ``fn`` once per replica, whatever the number of cores per replica.

    XLA only runs callbacks where every mesh axis is manual, so the call is wrapped in a
    shard_map over the remaining (``"model"``) axes; with several cores per replica only the
    first calls the host and the result is summed (zeros elsewhere) to every core.
    """
    auto = _auto_axes()
    if not auto:
        return fn(*values)
    mesh = jax.sharding.get_abstract_mesh()
    single = all(mesh.shape[a] == 1 for a in auto)

    def inner(*vals):
        if single:
            return fn(*vals)
        first = lax.axis_index(auto) == 0
        if specs is None:
            lax.cond(first, lambda: fn(*vals), lambda: None)
            return None
        zeros = [jnp.zeros(s.shape, s.dtype) for s in specs]
        out = lax.cond(first, lambda: list(fn(*vals)), lambda: zeros)
        return [_broadcast(o, auto) for o in out]

    out_specs = None if specs is None else [P() for _ in specs]
    return jax.shard_map(
        inner, in_specs=tuple(P() for _ in values), out_specs=out_specs, axis_names=set(auto)
    )(*values)


def _broadcast(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """First core's value on every core (the others hold zeros)."""
    if x.dtype == jnp.bool_:
        return lax.psum(x.astype(jnp.int32), axes) > 0
    return lax.psum(x, axes)


def _zero_tangent(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def _per_replica(x: jax.Array) -> jax.Array:
    """Types a host result as varying over the replica axis: each replica got its own."""
    axis = _axis_name()
    if axis is None:
        return x
    try:
        return lax.pcast(x, axis, to="varying")
    except (ValueError, NameError):  # not under shard_map over ``axis``
        return x


def outside_compilation(
    computation: Callable, *args: Any, result_shape: Any = INFER, **kwargs: Any
) -> Any:
    """Runs ``computation(*args, **kwargs)`` on the host from a replicated computation.

    Args:
      computation: a Python function of numpy arrays (and any non-array arguments, which
        are passed through unchanged).
      *args: its positional arguments; array leaves (of any pytree) go to the host as numpy
        arrays holding this replica's values.
      result_shape: keyword-only and reserved. A pytree of ``jax.ShapeDtypeStruct`` (or
        arrays) describing the result, ``None`` when the computation returns nothing, or
        left out to infer it by a dry run on zeros at trace time (see the module doc).
      **kwargs: its keyword arguments, like ``args``.

    Returns:
      The computation's result as device arrays (per replica), or None.

    Raises:
      ValueError: the result shape cannot be inferred (naming the computation and the error).
      RuntimeError: inside a computation being exported with ``jax.export``.

    Example:
      >>> estimator.outside_compilation(lambda x: float("1{}".format(int(x))), 1)  # plain call
      11.0
    """
    if not callable(computation):
        raise EstimatorTypeError(
            f"outside_compilation: computation must be callable, got {computation!r}"
        )
    if not in_replicated_context():
        return computation(*args, **kwargs)
    forbidden = getattr(_LOCAL, "forbidden", None)
    if forbidden:
        raise EstimatorRuntimeError(f"outside_compilation({_name(computation)}) {forbidden}")
    leaves, treedef = jax.tree.flatten((args, kwargs))
    is_array = [_is_array(x) for x in leaves]
    arrays = [jnp.asarray(x) for x, a in zip(leaves, is_array, strict=True) if a]

    def rebuild(values: list) -> tuple[tuple, dict]:
        it = iter(values)
        full = [next(it) if a else x for x, a in zip(leaves, is_array, strict=True)]
        return jax.tree.unflatten(treedef, full)

    if result_shape is INFER:
        key = _shape_key(computation, leaves, is_array, arrays)
        if key is None or key not in _INFERRED:
            expected = _dry_run(computation, rebuild, arrays)
            if key is not None:
                _INFERRED[key] = expected
        expected = _INFERRED[key] if key is not None else expected
    elif result_shape is None:
        expected = None
    else:
        expected = _structs(result_shape, "result_shape")
    if _initializing():
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), expected)
    return _host_call(computation, rebuild, arrays, expected)


__all__ = ["INFER", "forbid_host_calls", "in_replicated_context", "outside_compilation"]
