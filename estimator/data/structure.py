"""A batch's structure told in one line: the entries that came or went, and rows given as a
Python list of arrays.

JAX reads a Python list as a structure of separate entries, so rows given one array each
(``{"x": [row0, row1, ...]}``, ragged or not) make every row an entry. The errors about such
a batch used to print the whole structure (a ``PyTreeDef`` a screen long) or every row by
name; these helpers name the list and at most a few entries instead.

Example:
  >>> check_row_lists({"x": [np.zeros(3), np.zeros(4), np.zeros(3)]})
  Traceback (most recent call last):
  ...
  EstimatorValueError: input batch entry ['x'] is a Python list of 3 arrays whose first ...
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..core.errors import EstimatorValueError

SHOWN = 3  # entries named in a message; the rest are counted


def some(names: list[str]) -> str:
    """``a, b, c and 13 more``: the first few of ``names``, the rest counted."""
    if len(names) <= SHOWN + 1:
        return ", ".join(names)
    return f"{', '.join(names[:SHOWN])} and {len(names) - SHOWN} more"


def _name(path: tuple) -> str:
    return jax.tree_util.keystr(path) or "<batch>"


def change(expected: tuple[str, ...], tree: Any) -> str:
    """How ``tree``'s entries differ from the ``expected`` entry names, in a few words."""
    got = [_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    known, now = set(expected), set(got)
    gone = [n for n in expected if n not in now]
    came = [n for n in got if n not in known]
    parts = []
    if gone:
        parts.append(f"no longer has {some(gone)}")
    if came:
        parts.append(f"now has {some(came)}")
        listed = [g for g in gone if any(c.startswith(g + "[") for c in came)]
        if listed:
            parts.append(
                f"{some(listed)} became a Python list (rows given one by one?): make each "
                "entry one array of shape (batch, ...) in input_fn"
            )
    if not parts:  # the same entries in other containers (a tuple for a list, ...)
        parts.append("the same entries in other containers (a tuple for a list, or so)")
    return f"the first batch's entries were {some(list(expected))}; this batch {'; '.join(parts)}"


def check_row_lists(tree: Any) -> None:
    """Refuses a Python list of more than two arrays whose first dimensions differ (rows
    given one array each, ragged), named as one entry instead of row by row.

    Raises:
      EstimatorValueError: naming the list, how many arrays it holds and their shapes.
    """

    def visit(node: Any, path: tuple) -> None:
        if isinstance(node, list) and len(node) > 2 and all(_is_array(v) for v in node):
            shapes = [np.shape(v) for v in node]
            if len({s[:1] for s in shapes}) > 1:
                kinds = sorted(set(shapes), key=shapes.index)
                raise EstimatorValueError(
                    f"input batch entry {_name(path)} is a Python list of {len(node)} arrays "
                    f"whose first dimensions differ ({some([str(s) for s in kinds])}); JAX "
                    "reads a list as separate entries, and each must be one array of shape "
                    "(batch, ...). If these are rows of different lengths (ragged), pad them "
                    "to one length (and mask the padding) and stack them in input_fn "
                    "(np.stack)"
                )
        if isinstance(node, dict):
            children = [(jax.tree_util.DictKey(k), v) for k, v in node.items()]
        elif isinstance(node, list | tuple):
            children = [(jax.tree_util.SequenceKey(i), v) for i, v in enumerate(node)]
        else:
            return
        for key, child in children:
            visit(child, (*path, key))

    visit(tree, ())


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and len(np.shape(value)) >= 1
