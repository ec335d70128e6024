"""``trainable_variables()`` inside model_fn: TF's ``tf.trainable_variables()``.

Every tensorflow/tpu vision model adds L2 weight decay over the trainable variables, and
BERT hands them (``tvars``) to its optimizer. Here they are the ``params`` collection of
the modules model_fn has built so far, each as a ``Variable``:

- ``v.name`` is TF's form, ``dense/kernel:0`` (the name ``est.get_variable_names()`` shows,
  with TF's ``:0``); TF code that strips the suffix (``re.match("^(.*):\\d+$", name)``) or
  tests a substring (``'batch_normalization' not in v.name``) reads it unchanged. A batch
  norm's variables (``BatchNorm_0/scale:0``) also answer ``in`` for TF's names of them,
  ``batch_normalization``, ``gamma`` and ``beta`` (``VariableName``), so that filter leaves
  them out as it did in TF.
- ``v.value`` is the array, the one the loss is differentiated through in TRAIN mode.
  Arithmetic (``v * v``, ``v ** 2``, ``v @ x``), indexing and the array's own methods
  (``v.sum()``, ``v.astype(jnp.float32)``) work on the Variable itself. ``jnp`` functions
  need the array: ``jnp.asarray(v)`` or ``v.value`` (JAX 0.10 no longer converts other
  objects implicitly; TF's ``tf.nn.l2_loss(v)`` ports as ``jnp.sum(v ** 2) / 2``).
- A Variable is a pytree node over its array, so ``jax.tree.leaves(tvars)`` gives the arrays
  (``optax.tree.norm(tvars)`` works).

Batch-norm statistics and other collections are not trainable (as in TF);
``global_variables()`` lists them after the trainable ones, as ``batch_stats/BatchNorm_0/mean:0``
answering ``in`` for TF's ``moving_mean`` / ``moving_variance``, and ``get_collection`` answers
the collections TF programs read in model_fn (``"moving_vars"``, ``GraphKeys.UPDATE_OPS``):
EfficientNet's ``get_ema_vars()`` reads unchanged (``ExponentialMovingAverage.apply``).

Example:
  >>> def model_fn(features, labels, mode, params):
  ...     logits = Net()(features)
  ...     loss = xent(logits, labels) + 1e-4 * sum(
  ...         jnp.sum(v.astype(jnp.float32) ** 2) / 2
  ...         for v in estimator.trainable_variables() if "BatchNorm" not in v.name)
"""

from __future__ import annotations

import operator
import re
from typing import Any

import flax.linen as nn
import jax

from ..core import context
from ..core.errors import EstimatorRuntimeError, EstimatorValueError
from ..io.variables import named_variables


@jax.tree_util.register_pytree_node_class
class Variable:
    """One trainable variable as model_fn sees it: ``name`` (TF's ``dense/kernel:0``) and
    ``value`` (the array); operators and array methods act on the value."""

    __slots__ = ("name", "value")

    def __init__(self, name: str, value: Any):
        self.name = name
        self.value = value

    def tree_flatten(self):
        return (self.value,), self.name

    @classmethod
    def tree_unflatten(cls, name, children):
        return cls(name, children[0])

    def __jax_array__(self):
        return self.value

    def __array__(self, dtype=None, copy=None):
        import numpy as np

        return np.asarray(self.value, dtype=dtype)

    def __getattr__(self, attr: str) -> Any:  # shape, dtype, ndim, sum(), astype(), T, ...
        if attr.startswith("__") or attr in self.__slots__:  # unset slot: no recursion
            raise AttributeError(attr)
        return getattr(self.value, attr)

    def __getitem__(self, index: Any) -> Any:
        return self.value[index]

    def __len__(self) -> int:
        return len(self.value)

    def __repr__(self) -> str:
        shape = tuple(getattr(self.value, "shape", ()))
        dtype = getattr(self.value, "dtype", None)
        return f"<estimator.Variable {self.name!r} shape={shape} dtype={dtype}>"


def _value(x: Any) -> Any:
    return x.value if isinstance(x, Variable) else x


def _binary(op):
    return (
        lambda self, other: op(self.value, _value(other)),
        lambda self, other: op(_value(other), self.value),
    )


for _name, _op in (
    ("add", operator.add),
    ("sub", operator.sub),
    ("mul", operator.mul),
    ("truediv", operator.truediv),
    ("floordiv", operator.floordiv),
    ("mod", operator.mod),
    ("pow", operator.pow),
    ("matmul", operator.matmul),
):
    _fwd, _rev = _binary(_op)
    setattr(Variable, f"__{_name}__", _fwd)
    setattr(Variable, f"__r{_name}__", _rev)
for _name, _op in (
    ("lt", operator.lt),
    ("le", operator.le),
    ("gt", operator.gt),
    ("ge", operator.ge),
):
    setattr(Variable, f"__{_name}__", _binary(_op)[0])
Variable.__neg__ = lambda self: -self.value
Variable.__pos__ = lambda self: +self.value
Variable.__abs__ = lambda self: abs(self.value)


def trainable_variables(scope: str | None = None) -> list[Variable]:
    """The trainable variables model_fn has created so far (TF's ``tf.trainable_variables()``),
    in name order; see the module docstring for what a ``Variable`` is.

    Args:
      scope: TF's filter: only the variables whose name matches this regular expression at
        its start (``"Discriminator"``: those built under that ``variable_scope``).

    Raises:
      RuntimeError: outside a model_fn called by the estimator.

    Example:
      >>> decay = sum(jnp.sum(v ** 2) / 2 for v in estimator.trainable_variables())
    """
    root = context.current_root_module()
    if root is None or context.current() is None:
        raise EstimatorRuntimeError(
            "estimator.trainable_variables() can only be called inside model_fn (after the "
            "layers it lists are built); outside it, name the saved variables with "
            "est.get_variable_names()"
        )
    params = nn.meta.unbox(root.variables.get("params", {}))
    batch_norms = _batch_norm_paths(root)
    return [
        Variable(VariableName(f"{name}:0", _tf_aliases(name, batch_norms)), value)
        for name, value in sorted(named_variables(params).items())
        if scope is None or re.match(scope, name)
    ]


class VariableName(str):
    """A variable's name (``BatchNorm_0/scale:0``) that a substring test also matches against
    the names TF gave the same variable (``batch_normalization``, ``gamma``, ``beta`` for a
    batch norm's scale and bias), so TF's weight-decay filter ``'batch_normalization' not in
    v.name`` leaves a Flax BatchNorm out as it left TF's out. Only ``in`` sees the aliases;
    the text, ``==``, ``re`` and ``startswith`` are the name's own."""

    aliases: tuple[str, ...]

    def __new__(cls, name: str, aliases: tuple[str, ...] = ()):
        self = super().__new__(cls, name)
        self.aliases = aliases
        return self

    def __contains__(self, sub: object) -> bool:
        return str.__contains__(self, sub) or any(sub in a for a in self.aliases)

    def __reduce__(self):
        return VariableName, (str(self), self.aliases)


# TF's batch normalization named its scale and bias ``gamma`` and ``beta``.
_TF_BATCH_NORM_LEAVES = {"scale": "gamma", "bias": "beta"}


def _batch_norm_paths(root: nn.Module) -> set[str]:
    """The paths (``block/BatchNorm_0``) of the batch-norm modules built so far: Flax's
    ``nn.BatchNorm`` and any module class named like one (the zoo's, a user's)."""
    found: set[str] = set()

    def visit(module: nn.Module, path: tuple[str, ...]) -> None:
        for name, child in module._state.children.items():
            if not isinstance(child, nn.Module):  # a setup() name not yet bound
                continue
            here = (*path, name)
            kind = type(child).__name__.lower().replace("_", "")
            if isinstance(child, nn.BatchNorm) or "batchnorm" in kind:
                found.add("/".join(here))
            visit(child, here)

    visit(root, ())
    return found


def _tf_aliases(name: str, batch_norms: set[str]) -> tuple[str, ...]:
    module, _, leaf = name.rpartition("/")
    if module not in batch_norms:
        return ()
    return ("batch_normalization", *filter(None, [_TF_BATCH_NORM_LEAVES.get(leaf)]))


# ------------------------------------------------------------------ every variable: TF's names
# TF's batch normalization named its statistics ``moving_mean`` and ``moving_variance``.
_TF_BATCH_NORM_STATS = {"mean": "moving_mean", "var": "moving_variance"}


def global_variables(scope: str | None = None) -> list[Variable]:
    """Every variable model_fn has created so far (TF's ``tf.global_variables()``): the
    trainable ones, then every other collection's (BatchNorm's statistics), each in name
    order. Others are named with their collection in front, ``batch_stats/BatchNorm_0/mean:0``
    (the checkpoint's name); a batch norm's statistics also answer ``in`` for TF's names
    ``moving_mean`` / ``moving_variance`` (and ``batch_normalization``), so EfficientNet's
    ``'moving_mean' in v.name or 'moving_variance' in v.name`` picks them. The optimizer's
    slots and the global step are not variables of model_fn here (the estimator keeps them).

    Args:
      scope: TF's filter, matched at the start of the name (after the collection).

    Raises:
      RuntimeError: outside a model_fn called by the estimator.

    Example:
      >>> stats = [v for v in estimator.global_variables() if "moving_mean" in v.name]
    """
    out = trainable_variables(scope)
    root = context.current_root_module()
    batch_norms = _batch_norm_paths(root)
    for collection in sorted(c for c in root.variables if c != "params"):
        tree = nn.meta.unbox(root.variables[collection])
        for name, value in sorted(named_variables(tree).items()):
            if scope is not None and not re.match(scope, name):
                continue
            module, _, leaf = name.rpartition("/")
            stat = _TF_BATCH_NORM_STATS.get(leaf) if module in batch_norms else None
            aliases = ("batch_normalization", stat) if stat else ()
            out.append(Variable(VariableName(f"{collection}/{name}:0", aliases), value))
    return out


class GraphKeys:
    """The names of TF's graph collections that ``get_collection`` answers."""

    GLOBAL_VARIABLES = "variables"
    TRAINABLE_VARIABLES = "trainable_variables"
    UPDATE_OPS = "update_ops"
    MOVING_VARS = "moving_vars"  # TF-slim's BatchNorm statistics (EfficientNet's get_ema_vars)


def get_collection(key: str, scope: str | None = None) -> list:
    """TF's ``tf.get_collection(key, scope)`` inside model_fn, for the collections TF
    programs read there.

    - ``GraphKeys.TRAINABLE_VARIABLES`` / ``GLOBAL_VARIABLES``: ``trainable_variables(scope)`` /
      ``global_variables(scope)``.
    - ``"moving_vars"`` (TF-slim's): BatchNorm's moving statistics, as ``global_variables``
      names them.
    - ``GraphKeys.UPDATE_OPS``: ``[]``: the train step applies BatchNorm's updates itself,
      before the optimizer (so ``with control_dependencies(update_ops):`` orders nothing).

    Raises:
      ValueError: another collection (this estimator keeps no graph collections).

    Example:
      >>> ema_vars = estimator.trainable_variables() + estimator.get_collection("moving_vars")
    """
    if key == GraphKeys.TRAINABLE_VARIABLES:
        return trainable_variables(scope)
    if key == GraphKeys.GLOBAL_VARIABLES:
        return global_variables(scope)
    if key == GraphKeys.MOVING_VARS:
        stats = ("moving_mean", "moving_variance")
        return [v for v in global_variables(scope) if any(s in v.name for s in stats)]
    if key == GraphKeys.UPDATE_OPS:
        return []
    raise EstimatorValueError(
        f"estimator.get_collection({key!r}): there are no graph collections here; the ones "
        "TF programs read map as: trainable_variables, variables (global_variables), "
        "moving_vars (BatchNorm statistics) and update_ops (empty: the train step applies them)"
    )


__all__ = [
    "GraphKeys",
    "Variable",
    "VariableName",
    "get_collection",
    "global_variables",
    "trainable_variables",
]
