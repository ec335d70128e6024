"""TF's variable scopes in model_fn: ``variable_scope(name, reuse=AUTO_REUSE)``, ``get_variable``.

A TF program shares a network's variables by building it twice under one scope with reuse,
DCGAN's discriminator for one::

    def discriminator(x, is_training=True, scope="Discriminator"):
        with tf.variable_scope(scope, reuse=tf.AUTO_REUSE):
            x = _conv2d(x, 64, 4, 2, name="d_conv1")      # Discriminator/d_conv1/...
            ...

    d_on_data = discriminator(real_images)
    d_on_g = discriminator(generated_images)              # the same variables

Here the block reads the same with ``estimator.variable_scope`` and ``estimator.AUTO_REUSE``:
the Flax modules constructed inside become children of a module named ``scope`` under the
current one (the estimator's root in model_fn), so their variables are ``Discriminator/
d_conv1/kernel``. Entering the same name again in the same call of model_fn (or of the
enclosing module) with ``reuse=AUTO_REUSE`` or ``True`` re-enters that module: modules built
under the same names (``name=`` or Flax's per-type numbering ``Dense_0``, counted afresh on
each entry) bind to the first entry's variables. Without reuse the second entry is an error
that names the fix, as TF's "Variable ... already exists, disallowed" was.

What differs from TF: reuse applies to every module built in the block, named or not (TF's
unnamed ``tf.layers`` got fresh names per call and were NOT shared); ``reuse=True`` on a first
entry creates the variables (TF refused); the scope is per model_fn call, so sharing between
modes is the checkpoint's business as always. ``estimator.get_variable`` inside the block
creates ``scope/name``.

Example:
  >>> def discriminator(x):
  ...     with estimator.variable_scope("Discriminator", reuse=estimator.AUTO_REUSE):
  ...         return nn.Dense(1, name="d_fc")(nn.leaky_relu(nn.Dense(64, name="d_h0")(x)))
  >>> def model_fn(features, labels, mode, params):
  ...     d_real, d_fake = discriminator(features["real"]), discriminator(fake)  # one set
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import module as flax_module

from ..core.errors import EstimatorRuntimeError, EstimatorTypeError, EstimatorValueError
from .initializers import as_initializer


class _ReuseMode(enum.Enum):
    """TF's ``tf.AUTO_REUSE``: create on the first entry, reuse on the next ones."""

    AUTO_REUSE = 1


AUTO_REUSE = _ReuseMode.AUTO_REUSE


class _Scope(nn.Module):
    """The module a ``variable_scope`` block builds under; it holds no variables itself."""


class VariableScope:
    """What ``with variable_scope(...) as scope`` gives: ``scope.name`` is its path
    (``"outer/Discriminator"``), as TF's ``VariableScope.name``."""

    def __init__(self, name: str, reuse: Any):
        self.name = name
        self.reuse = reuse

    def __repr__(self) -> str:
        return f"VariableScope(name={self.name!r}, reuse={self.reuse!r})"


def current_module(what: str) -> nn.Module:
    """The Flax module that modules built now attach to: the estimator's root in model_fn,
    the innermost ``variable_scope``, or a module whose compact method is running."""
    parent = flax_module._context.module_stack[-1]
    if parent is None:
        raise EstimatorRuntimeError(
            f"estimator.{what} can only be called inside model_fn (or a Flax module's "
            "@nn.compact method), where the modules it builds have a parent"
        )
    return parent


def _scope_module(parent: nn.Module, name: str, reuse: Any, fresh: bool) -> _Scope:
    """The block's module: a new child of ``parent``, or the one an earlier entry made."""
    if not parent.scope.name_reserved(name):
        return _Scope(parent=parent, name=name)
    earlier = parent._state.children.get(name)
    if not isinstance(earlier, _Scope):
        raise EstimatorValueError(
            f"variable_scope({name!r}): {name!r} is already the name of a module or variable "
            f"in {parent.__class__.__name__} {'/'.join(parent.scope.path) or '(the root)'}; "
            "choose another scope name"
        )
    if fresh or not reuse:
        raise EstimatorValueError(
            f"variable_scope({name!r}) was entered a second time without reuse: its modules "
            f"would be created twice (TF: 'Variable {name}/... already exists, disallowed'). "
            "Pass reuse=estimator.AUTO_REUSE (or True) to share the first entry's variables, "
            "or use another name to build a separate copy"
        )
    return earlier


def _unique(parent: nn.Module, default_name: str) -> str:
    """TF's ``default_name``: ``bert``, then ``bert_1``, ``bert_2``, ... in one scope."""
    name, i = default_name, 0
    while parent.scope.name_reserved(name):
        i += 1
        name = f"{default_name}_{i}"
    return name


@contextlib.contextmanager
def variable_scope(
    name_or_scope: str | None = None,
    default_name: str | None = None,
    values: Any = None,
    reuse: Any = None,
) -> Iterator[VariableScope]:
    """TF's ``tf.variable_scope``: Flax modules built in the block live under ``name_or_scope``.

    Args:
      name_or_scope: the scope's name (a ``/``-free string).
      default_name: used, made unique (``name_1``, ...), when ``name_or_scope`` is None; such
        a scope is never reused (TF's rule).
      values: ignored (TF used it to pick the graph).
      reuse: ``estimator.AUTO_REUSE`` or True shares the variables of an earlier entry of the
        same name in this call; None or False makes a second entry an error.

    Yields:
      A ``VariableScope`` whose ``name`` is the scope's path.

    Raises:
      RuntimeError: outside model_fn.
      TypeError: no name.
      ValueError: a second entry without reuse, a name a module already has, or a ``/``.

    Example:
      >>> with estimator.variable_scope("Generator", reuse=estimator.AUTO_REUSE):
      ...     x = nn.Dense(7 * 7 * 128, name="g_fc1")(noise)
    """
    del values
    fresh = name_or_scope is None
    name = default_name if fresh else name_or_scope
    if not isinstance(name, str):
        raise EstimatorTypeError(
            f"variable_scope needs a name (name_or_scope or default_name), got "
            f"{name_or_scope!r} / {default_name!r}"
        )
    if not name or "/" in name:
        raise EstimatorValueError(
            f"variable_scope name {name!r}: give one without '/' (nest two blocks for a path)"
        )
    parent = current_module("variable_scope()")
    if fresh:
        name = _unique(parent, name)
    module = _scope_module(parent, name, reuse, fresh)
    with _building_under(module):
        yield VariableScope("/".join(module.scope.path), reuse)


def get_variable(
    name: str,
    shape: Sequence[int] | None = None,
    dtype: Any = None,
    initializer: Any = None,
    trainable: bool | None = None,
) -> jax.Array:
    """TF's ``tf.get_variable`` in model_fn: a trainable variable of the current scope.

    It is a Flax parameter of the module model_fn builds under (the estimator's root, or the
    innermost ``variable_scope``), so it is trained, checkpointed (``output_weights``,
    ``Discriminator/w``) and listed by ``trainable_variables()`` like a layer's. A second call
    with the same name in the same scope returns the same variable (TF's ``reuse``); a
    variable_scope entered again with reuse returns the first entry's.

    Args:
      name: the variable's name in its scope (no ``/``: nest ``variable_scope`` blocks).
      shape: its shape; None takes the shape of a value ``initializer``.
      dtype: its dtype (TF's default float32; a value initializer's own dtype when None).
      initializer: a JAX initializer ``(key, shape, dtype)``, a TF initializer object
        (``tf.truncated_normal_initializer(stddev=0.02)``, ``tf.zeros_initializer()``), an
        array or a number; None is TF's default (Glorot uniform for floats, else zeros). See
        ``engine/initializers.py``.
      trainable: True or None; a non-trainable variable has no counterpart (state lives in a
        Flax collection: ``self.variable("batch_stats", ...)`` in a module).

    Returns:
      The variable's value (an array; JAX has no variable objects).

    Raises:
      RuntimeError: outside model_fn.
      ValueError: no shape, another shape than the earlier one, or the name of a module.

    Example (BERT's classifier head):
      >>> output_weights = estimator.get_variable(
      ...     "output_weights", [num_labels, hidden_size],
      ...     initializer=jax.nn.initializers.truncated_normal(stddev=0.02))
      >>> output_bias = estimator.get_variable(
      ...     "output_bias", [num_labels], initializer=jax.nn.initializers.zeros)
      >>> logits = output_layer @ output_weights.T + output_bias
    """
    if trainable is False:
        raise EstimatorValueError(
            f"get_variable({name!r}, trainable=False): only trainable variables are made "
            "here; keep state in a Flax collection (self.variable('batch_stats', ...) in a "
            "module), which the estimator checkpoints and updates in TRAIN"
        )
    if not isinstance(name, str) or not name or "/" in name:
        raise EstimatorValueError(
            f"get_variable name {name!r}: use a name without '/' inside variable_scope blocks"
        )
    module = current_module("get_variable()")
    init, value_shape = as_initializer(initializer, dtype)
    if shape is None and value_shape is None:
        raise EstimatorValueError(
            f"get_variable({name!r}) needs a shape (or an array as its initializer)"
        )
    shape = tuple(int(d) for d in (value_shape if shape is None else shape))
    dtype = jnp.dtype(dtype) if dtype is not None else _default_dtype(initializer)
    if not module.scope.name_reserved(name):
        return module.param(name, init, shape, dtype)
    value = nn.meta.unbox(module.get_variable("params", name))
    if not hasattr(value, "shape"):  # None, or a submodule's dict of parameters
        raise EstimatorValueError(
            f"get_variable({name!r}): {name!r} is already a module's name in this scope"
        )
    if tuple(value.shape) != shape:
        raise EstimatorValueError(
            f"get_variable({name!r}) asked for shape {shape}, but the variable of that name "
            f"has shape {tuple(value.shape)}"
        )
    return value


def _default_dtype(initializer: Any) -> Any:
    """float32 (TF's default), or the dtype of a value initializer (an array's own)."""
    if isinstance(initializer, (np.ndarray, jax.Array)) and not callable(initializer):
        return jnp.dtype(initializer.dtype)
    return jnp.dtype(jnp.float32)


@contextlib.contextmanager
def _building_under(module: _Scope) -> Iterator[None]:
    """Runs the block as if it were ``module``'s compact method (what Flax does around one:
    ``Module._call_wrapped_method``), so the modules built in it become its children and a
    later entry may build the same names again."""
    stack = flax_module._context.module_stack
    module._state.in_compact_method = True
    stack.append(module)
    try:
        yield
    finally:
        stack.pop()
        # Names are reserved per call of a compact method: rewinding frees them for the next
        # entry, whose modules then bind to the same variables.
        object.__setattr__(module, "scope", module.scope.rewound())
        module._state.reset()


__all__ = ["AUTO_REUSE", "VariableScope", "current_module", "get_variable", "variable_scope"]
