"""Host functions that hold values from inside the compiled computation (``engine/traced.py``):
every way a function can capture a tracer is found and named, and JAX's tracer errors become
one ``TracedValueError`` naming the host function."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from estimator.core.errors import EstimatorValueError
from estimator.engine.traced import TracedValueError, check_no_traced_values, traced_value_guard


class _Holder:
    def __init__(self, value):
        self.value = value

    def method(self):
        return self.value


# How a host function captures value ``v``, and the name the error gives it.
CAPTURES = {
    "closure": (lambda v: lambda: v + 1, "'v'"),
    "closure in a dict": (lambda v: lambda d={"a": 1}: d["a"] + {"t": v}["t"], "'v'"),
    "partial argument": (lambda v: functools.partial(lambda a: a, v), "'argument 0'"),
    "partial keyword": (lambda v: functools.partial(lambda *, a: a, a=v), "\"argument 'a'\""),
    "default": (lambda v: lambda x=v: x, "'x'"),
    "keyword-only default": (lambda v: lambda *, y=v: y, "'y'"),
    "pytree in a closure": (lambda v: lambda: {"w": [v]}, "'v'"),
}


@pytest.mark.parametrize("make, name", CAPTURES.values(), ids=list(CAPTURES))
def test_a_captured_tracer_is_named(make, name):
    errors = []

    @jax.jit
    def f(x):
        try:
            check_no_traced_values(make(x), "host_call")
        except TracedValueError as e:
            errors.append(str(e))
        return x

    f(jnp.float32(1.0))
    assert len(errors) == 1
    assert errors[0].startswith(f"host_call captures {name}, which is a value computed inside")


@pytest.mark.parametrize("make, name", CAPTURES.values(), ids=list(CAPTURES))
def test_host_values_pass(make, name):
    check_no_traced_values(make(np.float32(1.0)), "host_call")  # nothing raised
    check_no_traced_values(make(jnp.float32(1.0)), "host_call")  # a concrete device array


def test_unflattenable_captures_and_builtins_pass():
    lock = __import__("threading").Lock()
    check_no_traced_values(lambda: lock, "scaffold_fn")
    check_no_traced_values(len, "scaffold_fn")  # no code object
    check_no_traced_values(_Holder(1).method, "scaffold_fn")


def test_traced_value_error_is_an_estimator_value_error():
    assert issubclass(TracedValueError, EstimatorValueError)
    assert issubclass(TracedValueError, ValueError)


# What a host function does with a tracer it reached, inside a trace.
MISUSES = {
    "float": float,
    "bool": bool,
    "int": int,
    "numpy": np.asarray,
}


@pytest.mark.parametrize("misuse", MISUSES.values(), ids=list(MISUSES))
def test_guard_turns_tracer_errors_into_one_error_naming_the_function(misuse):
    errors = []

    @jax.jit
    def f(x):
        try:
            with traced_value_guard("metric_fn"):
                misuse(x)
        except TracedValueError as e:
            errors.append(e)
        return x

    f(jnp.float32(1.0))
    assert len(errors) == 1
    assert str(errors[0]).startswith("metric_fn uses a value computed inside the compiled")
    assert isinstance(errors[0].__cause__, jax.errors.JAXTypeError | TypeError)


def test_guard_names_an_escaped_tracer_used_later():
    leaked = []
    jax.jit(lambda x: leaked.append(x) or x)(jnp.float32(1.0))
    with pytest.raises(TracedValueError, match="^host_call uses") as info:
        with traced_value_guard("host_call"):
            leaked[0] + 1
    assert isinstance(info.value.__cause__, jax.errors.UnexpectedTracerError)


def test_guard_passes_other_errors_through():
    with pytest.raises(KeyError, match="missing"):
        with traced_value_guard("host_call"):
            raise KeyError("missing")
    with traced_value_guard("host_call"):
        assert float(jnp.float32(2.0)) == 2.0  # concrete values are fine
