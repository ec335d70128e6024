"""One naming of variables, used wherever a user sees a variable's name.

``get_variable_names``/``get_variable_value``, ``list_variables``, warm start and
``init_from_checkpoint`` logs, checkpoint-mismatch errors and exported signatures all name a
variable the same way: ``params`` by module path (``dense1/kernel``, as TF named
``dense1/kernel``), every other collection with the collection in front
(``batch_stats/BatchNorm_0/mean``).

Example:
  >>> flatten({"params": {"dense": {"kernel": k}}, "batch_stats": {"bn": {"mean": m}}})
  {'dense/kernel': k, 'batch_stats/bn/mean': m}
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from ..core.errors import EstimatorTypeError, EstimatorValueError

PARAMS = "params"
#: The shadow of ``ExponentialMovingAverage`` in the optimizer state, and its name suffix.
MOVING_AVERAGE = "ExponentialMovingAverage"
EVAL_FLAG = "use_for_eval"


def key_name(key: Any) -> str:
    """One path element as text (dict key, attribute name or sequence index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path: tuple) -> str:
    """A pytree key path as ``a/b/0/c``."""
    return "/".join(key_name(k) for k in path)


def _prefix(collection: str) -> str:
    return "" if collection == PARAMS else f"{collection}/"


def flatten(variables: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: leaf}`` of a ``{collection: tree}`` dict, in tree order."""
    out = {}
    for collection, tree in variables.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            out[_prefix(collection) + path_name(path)] = leaf
    return out


def names(variables: Mapping[str, Any]) -> list[str]:
    """The names of every leaf, in the order ``jax.tree.leaves(variables)`` gives them."""
    # jax.tree.leaves sorts dict keys; flatten() walks the same sorted order per collection.
    ordered = {c: variables[c] for c in sorted(variables)}
    return list(flatten(ordered))


def shapes(variables: Mapping[str, Any]) -> dict[str, tuple]:
    """``{name: shape}`` of every array leaf (``None`` leaves skipped)."""
    return {
        n: tuple(getattr(x, "shape", ())) for n, x in flatten(variables).items() if x is not None
    }


def unflatten_into(variables: Mapping[str, Any], values: Mapping[str, Any]) -> dict:
    """``variables`` with the leaves named in ``values`` replaced."""

    def replace(collection, tree):
        def one(path, leaf):
            return values.get(_prefix(collection) + path_name(path), leaf)

        return jax.tree_util.tree_map_with_path(one, tree)

    return {c: replace(c, t) for c, t in variables.items()}


# --------------------------------------------------------------------------- moving averages
# ExponentialMovingAverage keeps its shadow in the optimizer state, in a field named
# "ExponentialMovingAverage" (next to "use_for_eval"); wherever the optimizer state is
# (``opt_state/ExponentialMovingAverage/dense/kernel``, or deeper inside a chain), the shadow
# of ``dense/kernel`` is named as TF named it: ``dense/kernel/ExponentialMovingAverage``.


def _keys(path: tuple) -> list[str]:
    return [key_name(k) for k in path]


def moving_average_names(train: Any) -> dict[str, Any]:
    """``{"<var>/ExponentialMovingAverage": leaf}`` of every moving-average shadow in a tree
    holding optimizer state (the checkpoint's ``train`` item, in memory, restored or as its
    metadata).

    Example:
      >>> moving_average_names({"opt_state": {"ExponentialMovingAverage": {"d": {"k": s}}}})
      {'d/k/ExponentialMovingAverage': s}
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(train)[0]:
        keys = _keys(path)
        if MOVING_AVERAGE not in keys[:-1]:
            continue
        at = len(keys) - 1 - keys[::-1].index(MOVING_AVERAGE)
        out["/".join(keys[at + 1 :]) + "/" + MOVING_AVERAGE] = leaf
    return out


def moving_average_for_eval(train: Any) -> dict[str, Any] | None:
    """The shadow (``{param name: leaf}``) of an ``ExponentialMovingAverage(use_for_eval=True)``
    in ``train``, or None when there is none or its flag is off. ``train`` holds arrays."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(train)[0]:
        keys = _keys(path)
        if keys and keys[-1] == EVAL_FLAG and int(jax.device_get(leaf)):
            at = len(keys) - 1
            shadow = {}
            for p, x in jax.tree_util.tree_flatten_with_path(train)[0]:
                k = _keys(p)
                if k[:at] == keys[:at] and len(k) > at + 1 and k[at] == MOVING_AVERAGE:
                    shadow["/".join(k[at + 1 :])] = x
            return shadow
    return None


def has_moving_average(train: Any) -> bool:
    """Whether a ``train`` tree (arrays or metadata) holds a moving-average shadow."""
    return bool(moving_average_names(train))


# --------------------------------------------------------------------------- masks by name
# TF programs pick variables by name: BERT excludes "LayerNorm" and "bias" from weight decay
# (re.search over each name), fine-tuning scripts freeze "bert/embeddings/". These build the
# same selections over a params pytree, named as above (a TF ":0" suffix in a pattern is
# ignored):
#     decay = estimator.name_mask(exclude=["LayerNorm", "layer_norm", "bias"])
#     tx = optax.adamw(lr, weight_decay=0.01, mask=decay)
#     frozen = estimator.name_mask([r"^bert/embeddings/"])
#     tx = optax.chain(optax.masked(optax.set_to_zero(), frozen), tx)


def named_variables(tree: Any) -> dict[str, Any]:
    """A ``{name: leaf}`` view of one pytree, e.g. params (TF's ``{v.name: v}`` over
    ``tf.trainable_variables()``).

    Example:
      >>> sorted(named_variables({"dense": {"kernel": w, "bias": b}}))
      ['dense/bias', 'dense/kernel']
    """
    return {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _patterns(patterns: str | Iterable[str] | None, what: str) -> list[re.Pattern]:
    if patterns is None:
        return []
    if isinstance(patterns, str):
        patterns = [patterns]
    out = []
    for p in patterns:
        if not isinstance(p, str):
            raise EstimatorTypeError(f"name_mask {what} patterns must be str, got {p!r}")
        out.append(re.compile(re.sub(r":\d+$", "", p)))
    return out


def name_matcher(
    include: str | Iterable[str] | None = None, *, exclude: str | Iterable[str] | None = None
) -> Callable[[str], bool]:
    """``name -> bool``: matches some ``include`` pattern (every name when None) and no
    ``exclude`` pattern; patterns are regular expressions searched anywhere in the name."""
    inc, exc = _patterns(include, "include"), _patterns(exclude, "exclude")
    if include is not None and not inc:
        raise EstimatorValueError(
            "name_mask include patterns are empty; pass None to include every name"
        )

    def matches(name: str) -> bool:
        if inc and not any(r.search(name) for r in inc):
            return False
        return not any(r.search(name) for r in exc)

    return matches


def name_mask(
    include: str | Iterable[str] | None = None, *, exclude: str | Iterable[str] | None = None
) -> Callable[[Any], Any]:
    """An optax mask function selecting parameters by TF-style name.

    Args:
      include: regular expression(s) ``re.search``-ed in each name
        (``bert/encoder/layer_0/attention/self/query/kernel``); ``None`` selects every
        parameter.
      exclude: keyword-only; regular expression(s) that deselect a name (BERT's
        ``exclude_from_weight_decay``).

    Returns:
      ``mask_fn(params) -> pytree of bool`` (the structure of ``params``), as optax's
      ``mask=`` arguments (``optax.masked``, ``optax.adamw``, ``add_decayed_weights``) take.

    Example:
      >>> mask_fn = name_mask(exclude=["LayerNorm", "bias"])
      >>> mask_fn({"dense": {"kernel": w, "bias": b}})
      {'dense': {'bias': False, 'kernel': True}}
    """
    matches = name_matcher(include, exclude=exclude)

    def mask_fn(params: Any) -> Any:
        return jax.tree_util.tree_map_with_path(lambda p, _: matches(path_name(p)), params)

    return mask_fn
