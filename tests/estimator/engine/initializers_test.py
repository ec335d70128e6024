"""``get_variable``'s ``initializer=`` (``engine/initializers.py``): JAX initializers pass
through, TF initializer objects map to the JAX initializer of the same distribution, values
become constants, None is TF's default.

TensorFlow is not installed: a TF initializer here is an object of a class whose module is
``tensorflow...`` with TF's ``get_config()``, which is all the mapping reads. Distributions
are checked against bounds and moments computed in the test from TF's definitions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from estimator.core.errors import EstimatorTypeError, EstimatorValueError
from estimator.engine.initializers import as_initializer

# The standard deviation of a standard normal truncated at +-2: TF's and JAX's truncated
# normals both cut at two untruncated standard deviations.
TRUNC_STD = 0.8796256610342398


def _tf(kind: str, **config):
    """A stand-in for ``tf.keras.initializers.<kind>(**config)``."""
    cls = type(kind, (), {"__module__": "tensorflow.python.ops.init_ops_v2"})
    cls.get_config = lambda self: dict(config)
    return cls()


def _draw(initializer, shape, dtype=jnp.float32, seed=0) -> np.ndarray:
    init, value_shape = as_initializer(initializer, dtype)
    assert value_shape is None
    return np.asarray(init(jax.random.key(seed), shape, dtype))


def _uniform(limit: float, shift: float = 0.0):
    """(low, high, mean, std) of U(shift - limit, shift + limit)."""
    return shift - limit, shift + limit, shift, limit / math.sqrt(3)


def _truncated(std: float, mean: float = 0.0):
    return mean - 2 * std, mean + 2 * std, mean, std * TRUNC_STD


BIG = (400, 250)  # fan_in 400, fan_out 250: 100k draws
# TF initializer, shape -> (low, high, mean, std) from TF's definition
DISTRIBUTIONS = {
    "TruncatedNormal": (_tf("TruncatedNormal", mean=1.0, stddev=0.02), BIG, _truncated(0.02, 1.0)),
    "RandomNormal": (
        _tf("RandomNormal", mean=-0.5, stddev=0.1),
        BIG,
        (-math.inf, math.inf, -0.5, 0.1),
    ),
    "RandomUniform": (_tf("RandomUniform", minval=-0.2, maxval=0.6), BIG, _uniform(0.4, 0.2)),
    "GlorotUniform": (_tf("GlorotUniform"), BIG, _uniform(math.sqrt(6 / (400 + 250)))),
    "GlorotNormal": (_tf("GlorotNormal"), BIG, _truncated(math.sqrt(2 / 650) / TRUNC_STD)),
    "HeNormal": (_tf("HeNormal"), BIG, _truncated(math.sqrt(2 / 400) / TRUNC_STD)),
    "HeUniform": (_tf("HeUniform"), BIG, _uniform(math.sqrt(6 / 400))),
    "LecunUniform": (_tf("LecunUniform"), BIG, _uniform(math.sqrt(3 / 400))),
    "VarianceScaling fan_out uniform": (
        _tf("VarianceScaling", scale=2.0, mode="fan_out", distribution="uniform"),
        BIG,
        _uniform(math.sqrt(3 * 2.0 / 250)),
    ),
    # TF's fans of a vector of n are n and n: limit sqrt(3 / n)
    "GlorotUniform of a vector": (_tf("GlorotUniform"), (2000,), _uniform(math.sqrt(3 / 2000))),
    # ... in every mode and distribution (TF's _compute_fans: fan_in = fan_out = n)
    "HeNormal of a vector": (_tf("HeNormal"), (4000,), _truncated(math.sqrt(2 / 4000) / TRUNC_STD)),
    "VarianceScaling fan_out normal of a vector": (
        _tf("VarianceScaling", scale=3.0, mode="fan_out", distribution="untruncated_normal"),
        (4000,),
        (-math.inf, math.inf, 0.0, math.sqrt(3.0 / 4000)),
    ),
    "VarianceScaling fan_avg uniform of a scalar": (
        _tf("VarianceScaling", scale=0.5, mode="fan_avg", distribution="uniform"),
        (),
        _uniform(math.sqrt(3 * 0.5)),
    ),
}


@pytest.mark.parametrize("tf_init, shape, moments", DISTRIBUTIONS.values(), ids=list(DISTRIBUTIONS))
def test_tf_initializers_map_to_the_same_distribution(tf_init, shape, moments):
    low, high, mean, std = moments
    x = _draw(tf_init, shape)
    assert x.shape == shape and x.dtype == np.float32
    assert x.min() >= low - 1e-6 and x.max() <= high + 1e-6
    np.testing.assert_allclose(x.mean(), mean, atol=4 * std / math.sqrt(x.size))
    # fixed seeds: deterministic; about 4 standard errors of a sample std wide
    np.testing.assert_allclose(x.std(), std, rtol=max(0.02, 4 / math.sqrt(x.size)))


@pytest.mark.parametrize(
    "tf_init, value",
    [(_tf("Zeros"), 0.0), (_tf("Ones"), 1.0), (_tf("Constant", value=2.5), 2.5)],
    ids=["Zeros", "Ones", "Constant"],
)
def test_tf_constant_initializers(tf_init, value):
    np.testing.assert_array_equal(_draw(tf_init, (3, 2)), np.full((3, 2), value, np.float32))


def test_tf_orthogonal_is_orthogonal():
    q = _draw(_tf("Orthogonal", gain=1.0), (8, 8))
    np.testing.assert_allclose(q @ q.T, np.eye(8), atol=1e-5)


@pytest.mark.parametrize("shape", [(), (1,), (5,)])
def test_variance_scaling_of_a_scalar_or_vector_has_the_requested_shape(shape):
    x = _draw(_tf("GlorotUniform"), shape)
    n = shape[0] if shape else 1
    assert x.shape == shape and np.all(np.abs(x) <= math.sqrt(3 / n) + 1e-6)


def _largest_intermediate(init, shape) -> int:
    """Elements of the largest value computed while drawing ``shape`` (traced, not run)."""
    jaxpr = jax.make_jaxpr(lambda key: init(key, shape, jnp.float32))(jax.random.key(0))
    sizes = [math.prod(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.outvars]
    return max(sizes, default=0)


@pytest.mark.parametrize("initializer", [None, _tf("GlorotUniform")], ids=["default", "tf"])
def test_drawing_a_vector_costs_memory_of_the_vector(initializer):
    init, _ = as_initializer(initializer, jnp.float32)
    n = 100_000
    assert _largest_intermediate(init, (n,)) <= 4 * n


def test_a_tf_initializer_without_a_counterpart_is_named():
    with pytest.raises(EstimatorTypeError, match="TF initializer Identity has no JAX counterpart"):
        as_initializer(_tf("Identity"), jnp.float32)


def test_an_unknown_distribution_is_refused():
    with pytest.raises(EstimatorValueError, match="unknown variance-scaling distribution 'cauchy'"):
        as_initializer(_tf("VarianceScaling", distribution="cauchy"), jnp.float32)


def test_jax_initializers_pass_through():
    init = jax.nn.initializers.truncated_normal(0.02)
    got, shape = as_initializer(init, jnp.float32)
    assert got is init and shape is None


@pytest.mark.parametrize(
    "value, shape",
    [(3.0, ()), ([1.0, 2.0, 3.0], (3,)), (np.arange(6.0).reshape(2, 3), (2, 3))],
)
def test_a_value_becomes_a_constant_of_its_shape(value, shape):
    init, got_shape = as_initializer(value, jnp.float32)
    assert got_shape == shape
    out = init(jax.random.key(0), shape, jnp.float32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(value, np.float32))
    assert out.dtype == jnp.float32


def test_none_is_glorot_uniform_for_floats_and_zeros_otherwise():
    x = _draw(None, BIG)
    low, high, _, std = _uniform(math.sqrt(6 / 650))
    assert x.min() >= low - 1e-6 and x.max() <= high + 1e-6
    np.testing.assert_allclose(x.std(), std, rtol=0.03)
    init, _ = as_initializer(None, jnp.int32)
    np.testing.assert_array_equal(np.asarray(init(jax.random.key(0), (2, 2), jnp.int32)), 0)
