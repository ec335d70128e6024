"""The naive one-loss port of a two-optimizer program, caught: a WARNING that says how to write it.

A GAN ported to one loss, ``loss=g_loss`` with ``optax.chain(optax.masked(d_opt, d_mask),
optax.masked(g_opt, g_mask))``, runs without error and trains the discriminator on the
generator's loss (issue 41: every sample the same blank image). The optimizer state tells
the pattern apart: a chain (a plain tuple of states) holding several ``optax.MaskedState`` s
whose per-variable slots (Adam's moments, momentum) cover disjoint variables. ``warn`` logs
one WARNING per process naming the sets and the ``estimator.group(estimator.minimize(...))``
form (``multi_loss``); ``train_op=estimator.minimize(loss, chain)`` marks one loss as intended
and is never checked.

Not flagged: masked optimizers without per-variable state (two masked plain SGDs, the
``masked(set_to_zero(), frozen)`` freeze idiom), overlapping masks, a mask nested inside
another transformation's chain (``adamw(mask=...)``), and ``optax.multi_transform`` (optax's
idiom for parameter groups of one loss).

Example:
  >>> tx = optax.chain(optax.masked(adam, d_mask), optax.masked(adam, g_mask))
  >>> masked_chains(jax.eval_shape(tx.init, params), params)
  [[{'D/k', 'D/b'}, {'G/k'}]]
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax
import optax

log = logging.getLogger("estimator")

_WARNED: set[str] = set()  # the warnings given in this process


def _covered(node: Any, ref: Any, path: tuple) -> set[str] | None:
    """The names of ``ref``'s leaves that ``node`` mirrors (a state tree shaped like the
    params, with ``optax.MaskedNode`` where the mask is off); None when it does not mirror."""
    if isinstance(node, optax.MaskedNode):
        return set()
    if isinstance(ref, Mapping):
        if not isinstance(node, Mapping) or set(node) != set(ref):
            return None
        out: set[str] = set()
        for k in ref:
            found = _covered(node[k], ref[k], (*path, str(k)))
            if found is None:
                return None
            out |= found
        return out
    if hasattr(node, "shape") and hasattr(ref, "shape") and tuple(node.shape) == ref.shape:
        return {"/".join(path)}
    return None


def _children(node: Any) -> list:
    if isinstance(node, Mapping):
        return list(node.values())
    if isinstance(node, list | tuple):
        return list(node)
    return []


def _state_names(state: Any, params: Any) -> set[str]:
    """The variables a masked optimizer keeps per-variable state for (its slots)."""
    found = _covered(state, params, ()) if isinstance(params, Mapping) and params else None
    if found is not None:
        return found
    out: set[str] = set()
    for child in _children(state):
        out |= _state_names(child, params)
    return out


def masked_chains(opt_state: Any, params: Any) -> list[list[set[str]]]:
    """For every chain holding several ``optax.masked`` optimizers with per-variable state
    over disjoint variables: the variable names of each."""
    found = []
    for node in [opt_state, *_descendants(opt_state)]:
        if type(node) is not tuple:  # a chain's state is a plain tuple of its parts' states
            continue
        sets = [
            _state_names(s.inner_state, params) for s in node if isinstance(s, optax.MaskedState)
        ]
        sets = [s for s in sets if s]
        disjoint = sum(len(s) for s in sets) == len(set().union(*sets)) if sets else False
        if len(sets) >= 2 and disjoint:
            found.append(sets)
    return found


def _descendants(node: Any) -> list:
    out = []
    for child in _children(node):
        out.append(child)
        out.extend(_descendants(child))
    return out


def _describe(names: set[str]) -> str:
    parts = [n.split("/") for n in sorted(names)]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if common and len(names) > 1:
        return f"{'/'.join(common)}/* ({len(names)} variables)"
    shown = sorted(names)
    return ", ".join(shown[:3]) + (f", ... ({len(shown)} variables)" if len(shown) > 3 else "")


def warn(train_op: Any, params: Any) -> None:
    """Logs one WARNING (once per process and message) when ``train_op`` chains several
    masked optimizers over disjoint variables, all trained on the spec's one loss."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    try:
        opt_state = jax.eval_shape(train_op.init, shapes)
    except Exception:  # noqa: BLE001 - init fails later with its own message
        return
    for sets in masked_chains(opt_state, shapes):
        described = " and ".join(f"[{_describe(s)}]" for s in sets)
        message = (
            f"train_op chains {len(sets)} optax.masked optimizers over disjoint variables, "
            f"{described}, and all of them are trained on the spec's one loss. If each set "
            "has its own loss (a GAN, actor-critic: TF's tf.group(d_opt.minimize(d_loss, "
            "var_list=...), g_opt.minimize(g_loss, var_list=...))), write train_op="
            "estimator.group(estimator.minimize(d_loss, d_opt, var_list='Discriminator'), "
            "estimator.minimize(g_loss, g_opt, var_list='Generator')). If one loss is "
            "intended, write train_op=estimator.minimize(loss, <this chain>) and this "
            "warning goes away"
        )
        if message not in _WARNED:
            _WARNED.add(message)
            log.warning("%s", message)


__all__ = ["masked_chains", "warn"]
