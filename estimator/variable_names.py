"""TF-style variable names for optax masks: weight decay or freezing by name.

TF programs pick variables by name: BERT excludes ``LayerNorm`` and ``bias`` from weight decay
(``re.search`` over each variable's name), fine-tuning scripts freeze ``bert/embeddings/*``.
Here the parameters are a pytree; their names are the module path joined by ``/``, exactly as
``TPUEstimator.get_variable_names()`` and ``estimator.list_variables`` show them
(``bert/encoder/layer_0/attention/self/query/kernel``; a TF ``:0`` suffix in a pattern is
ignored).

Example (BERT's AdamWeightDecayOptimizer and a frozen embedding):
  >>> decay = estimator.name_mask(exclude=["LayerNorm", "layer_norm", "bias"])
  >>> tx = optax.adamw(lr, weight_decay=0.01, mask=decay)
  >>> frozen = estimator.name_mask([r"^bert/embeddings/"])
  >>> tx = optax.chain(optax.masked(optax.set_to_zero(), frozen), tx)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import jax

PyTree = Any


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def variable_name(path: tuple) -> str:
    """The ``/``-joined name of one leaf's pytree path."""
    return "/".join(_key(k) for k in path)


def variable_names(tree: PyTree) -> PyTree:
    """``tree`` with each leaf replaced by its TF-style name (the same structure).

    Example:
      >>> variable_names({"dense": {"kernel": w, "bias": b}})
      {'dense': {'bias': 'dense/bias', 'kernel': 'dense/kernel'}}
    """
    return jax.tree_util.tree_map_with_path(lambda p, _: variable_name(p), tree)


def named_variables(tree: PyTree) -> dict[str, Any]:
    """A ``{name: leaf}`` view of ``tree`` (TF's ``{v.name: v}`` over trainable variables).

    Example:
      >>> sorted(named_variables({"dense": {"kernel": w, "bias": b}}))
      ['dense/bias', 'dense/kernel']
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {variable_name(p): x for p, x in leaves}


def _compile(patterns: str | Iterable[str] | None, what: str) -> list[re.Pattern]:
    if patterns is None:
        return []
    if isinstance(patterns, str):
        patterns = [patterns]
    out = []
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"name_mask {what} patterns must be str, got {p!r}")
        out.append(re.compile(re.sub(r":\d+$", "", p)))
    return out


def name_matcher(
    include: str | Iterable[str] | None = None, *, exclude: str | Iterable[str] | None = None
) -> Callable[[str], bool]:
    """``name -> bool``: matches some ``include`` pattern (all names when None) and no
    ``exclude`` pattern; patterns are regular expressions searched anywhere in the name."""
    inc, exc = _compile(include, "include"), _compile(exclude, "exclude")
    if include is not None and not inc:
        raise ValueError("name_mask include patterns are empty; pass None to include every name")

    def matches(name: str) -> bool:
        if inc and not any(r.search(name) for r in inc):
            return False
        return not any(r.search(name) for r in exc)

    return matches


def name_mask(
    include: str | Iterable[str] | None = None, *, exclude: str | Iterable[str] | None = None
) -> Callable[[PyTree], PyTree]:
    """An optax mask function selecting parameters by TF-style name.

    Args:
      include: regular expression(s) ``re.search``-ed in each name; ``None`` selects every
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

    def mask_fn(params: PyTree) -> PyTree:
        return jax.tree_util.tree_map_with_path(lambda p, _: matches(variable_name(p)), params)

    return mask_fn


__all__ = ["name_mask", "name_matcher", "named_variables", "variable_name", "variable_names"]
