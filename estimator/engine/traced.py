"""Host functions must not hold values from inside the compiled computation.

host_call, metric_fn, scaffold_fn and ``Scaffold.init_fn`` run on the host, outside the
traced model_fn. A value they capture from it (a tracer) cannot be read there; JAX's errors
about escaped tracers are turned into one ``TracedValueError`` that names the function.

Example:
  >>> with traced_value_guard("host_call"):
  ...     host_fn(*tensors)     # a leaked tracer raises TracedValueError("host_call uses ...")
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import jax

from ..core.errors import EstimatorValueError

_TRACER_ERRORS = (
    jax.errors.UnexpectedTracerError,
    jax.errors.TracerArrayConversionError,
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
)


class TracedValueError(EstimatorValueError):
    """A host function uses a value computed inside the compiled computation."""


def _captured(fn: Any) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of what a function closes over, binds or defaults to."""
    if isinstance(fn, functools.partial):
        yield from ((f"argument {i}", a) for i, a in enumerate(fn.args))
        yield from ((f"argument {k!r}", v) for k, v in fn.keywords.items())
        fn = fn.func
    fn = getattr(fn, "__func__", fn)  # bound methods: look at the function
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    names = code.co_freevars if code is not None else ()
    for name, cell in zip(names, cells, strict=False):
        try:
            yield name, cell.cell_contents
        except ValueError:  # an empty cell
            continue
    defaults = getattr(fn, "__defaults__", None) or ()
    if code is not None and defaults:
        with_defaults = code.co_varnames[code.co_argcount - len(defaults) : code.co_argcount]
        yield from zip(with_defaults, defaults, strict=True)
    yield from (getattr(fn, "__kwdefaults__", None) or {}).items()


def check_no_traced_values(fn: Any, what: str) -> None:
    """Raises when ``fn`` captured a value from inside the compiled computation.

    Raises:
      TracedValueError: naming ``what`` and the captured variable.
    """
    for name, value in _captured(fn):
        try:
            leaves = jax.tree.leaves(value)
        except Exception:  # noqa: BLE001 - an object jax cannot flatten holds no tracer
            continue
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            raise TracedValueError(_traced_message(what, f"captures {name!r}, which is"))


def _traced_message(what: str, detail: str) -> str:
    return (
        f"{what} {detail} a value computed inside the compiled model_fn. {what} runs on the "
        "host, after the device loop: pass device values through its tensors (host_call / "
        "eval_metrics) instead of capturing them, and use only Python values otherwise."
    )


@contextlib.contextmanager
def traced_value_guard(what: str):
    """Turns JAX's errors about escaped tracers into a clear ``TracedValueError``."""
    try:
        yield
    except _TRACER_ERRORS as e:
        raise TracedValueError(_traced_message(what, "uses")) from e
