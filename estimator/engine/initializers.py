"""The ``initializer=`` of ``estimator.get_variable``: JAX initializers, TF's, or a value.

``get_variable`` creates a Flax parameter, whose initializer is called ``(key, shape, dtype)``.
It is given one of:

- a JAX initializer (``jax.nn.initializers.truncated_normal(0.02)``, ``...zeros``);
- a TF initializer object (``tf.truncated_normal_initializer(stddev=0.02)``,
  ``tf.zeros_initializer()``, ``tf.keras.initializers.GlorotUniform()``, ...), where a ported
  program still imports TF: it maps to the JAX initializer with the same distribution (TF's
  truncated normal and JAX's both cut at two untruncated standard deviations; variance
  scaling computes fans the same way). The draws differ (another random generator); a TF
  initializer with no JAX counterpart is an error naming it;
- an array or a number (TF's ``initializer=tf.constant(...)``): the variable starts as it;
- None: TF's default, Glorot uniform for floating dtypes and zeros otherwise.

Example:
  >>> init, shape = as_initializer(tf.truncated_normal_initializer(stddev=0.02), None)
  >>> init(jax.random.key(0), (2, 3), jnp.float32).shape
  (2, 3)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.nn import initializers as jinit

from ..core.errors import EstimatorTypeError, EstimatorValueError

Initializer = Callable[[Any, tuple, Any], Any]

_TF_MODULES = ("tensorflow", "keras", "tf_keras")
# TF's variance-scaling distributions by JAX's names ("normal" was TF 1's truncated normal).
_DISTRIBUTIONS = {
    "normal": "truncated_normal",
    "truncated_normal": "truncated_normal",
    "untruncated_normal": "normal",
    "uniform": "uniform",
}


def _shifted(init: Initializer, shift: float) -> Initializer:
    if not shift:
        return init
    return lambda key, shape, dtype=jnp.float32: init(key, shape, dtype) + jnp.asarray(shift, dtype)


def _uniform(minval: float, maxval: float) -> Initializer:
    return _shifted(jinit.uniform(maxval - minval), minval)


def _variance_scaling(scale: float, mode: str, distribution: str) -> Initializer:
    """JAX's ``variance_scaling``, with TF's fans for a vector (n, n) or a scalar (1, 1),
    which JAX refuses (``get_variable("output_bias", [3])`` with TF's default)."""
    dist = _DISTRIBUTIONS.get(distribution)
    if dist is None:
        raise EstimatorValueError(f"unknown variance-scaling distribution {distribution!r}")
    matrix = jinit.variance_scaling(scale, mode, dist)
    # TF's ``_compute_fans``: a vector of n has fan_in = fan_out = n, a scalar 1 and 1. JAX
    # gives those fans to a (1, 1, n) array whose third axis is the receptive field (fan_in =
    # 1 * n, fan_out = 1 * n), so a vector draws its own n values (every mode and
    # distribution as TF), not a row of an (n, n) matrix (n * n values).
    vector = jinit.variance_scaling(scale, mode, dist, in_axis=0, out_axis=1)

    def init(key, shape, dtype=jnp.float32):
        shape = tuple(shape)
        if len(shape) >= 2:
            return matrix(key, shape, dtype)
        n = shape[0] if shape else 1
        return jnp.reshape(vector(key, (1, 1, n), dtype), shape)

    return init


def _tf_variance_scaling(cfg: dict) -> Initializer:
    return _variance_scaling(
        cfg.get("scale", 1.0), cfg.get("mode", "fan_in"), cfg.get("distribution", "normal")
    )


# TF's class name -> the JAX initializer for its get_config().
_FROM_TF: dict[str, Callable[[dict], Initializer]] = {
    "Zeros": lambda c: jinit.zeros,
    "Ones": lambda c: jinit.ones,
    "Constant": lambda c: jinit.constant(c.get("value", 0.0)),
    "TruncatedNormal": lambda c: _shifted(
        jinit.truncated_normal(c.get("stddev", 1.0)), c.get("mean", 0.0)
    ),
    "RandomNormal": lambda c: _shifted(jinit.normal(c.get("stddev", 1.0)), c.get("mean", 0.0)),
    "RandomUniform": lambda c: _uniform(c.get("minval", 0.0), c.get("maxval", 1.0)),
    "VarianceScaling": _tf_variance_scaling,
    "GlorotUniform": lambda c: _variance_scaling(1.0, "fan_avg", "uniform"),
    "GlorotNormal": lambda c: _variance_scaling(1.0, "fan_avg", "truncated_normal"),
    "HeNormal": lambda c: _variance_scaling(2.0, "fan_in", "truncated_normal"),
    "HeUniform": lambda c: _variance_scaling(2.0, "fan_in", "uniform"),
    "LecunNormal": lambda c: _variance_scaling(1.0, "fan_in", "truncated_normal"),
    "LecunUniform": lambda c: _variance_scaling(1.0, "fan_in", "uniform"),
    "Orthogonal": lambda c: jinit.orthogonal(c.get("gain", 1.0)),
}


def _is_tf(initializer: Any) -> bool:
    return type(initializer).__module__.split(".")[0] in _TF_MODULES


def _from_tf(initializer: Any) -> Initializer:
    kind = type(initializer).__name__
    if kind not in _FROM_TF:
        raise EstimatorTypeError(
            f"TF initializer {kind} has no JAX counterpart here; pass a jax.nn.initializers "
            f"function instead (mapped: {', '.join(sorted(_FROM_TF))})"
        )
    config = initializer.get_config() if hasattr(initializer, "get_config") else {}
    return _FROM_TF[kind](config)


def _default(dtype: Any) -> Initializer:
    """TF's ``get_variable`` default: Glorot uniform for floats, zeros for the rest."""
    if jnp.issubdtype(dtype, jnp.floating):
        return _variance_scaling(1.0, "fan_avg", "uniform")  # Glorot uniform
    return jinit.zeros


def as_initializer(initializer: Any, dtype: Any) -> tuple[Initializer, tuple | None]:
    """``(init(key, shape, dtype), shape of a value initializer or None)`` for ``initializer``.

    Raises:
      TypeError: a TF initializer with no JAX counterpart.
    """
    if initializer is None:
        return _default(jnp.dtype(dtype or jnp.float32)), None
    if _is_tf(initializer) and not hasattr(initializer, "shape"):
        return _from_tf(initializer), None
    if callable(initializer):
        return initializer, None
    value = np.asarray(initializer)  # a TF eager tensor or numpy/JAX array or a number

    def constant(key, shape, dtype=None):
        del key
        return jnp.broadcast_to(jnp.asarray(value, dtype), shape)

    return constant, tuple(value.shape)


__all__ = ["Initializer", "as_initializer"]
