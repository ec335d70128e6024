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

from collections.abc import Mapping
from typing import Any

import jax

PARAMS = "params"


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
