"""The all-finite check of the training state: no checkpoint ever holds a NaN or Inf.

The compiled train step returns, for every step, one flag per floating-point leaf of the new
params, the other collections and the optimizer state (``engine.loops.finite_flags``). The
training loop checks them right after each device loop, before hooks run and before anything
is saved, so a NaN that reached the state with a finite loss (a NaN gradient, an optimizer
that divides by zero) stops training with ``NanLossDuringTrainingError`` naming the first
non-finite step and what was non-finite; the newest checkpoint stays the last finite state.

Example:
  >>> names = state_leaf_names(state.params, state.state, state.opt_state)  # once per call
  >>> check_finite(flags, losses, steps, names)  # after every device loop
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..errors import NanLossDuringTrainingError
from ..io.variables import path_name

_SHOWN = 4  # names listed in the error


def first_step_hint(step: int | None) -> str:
    """What a non-finite loss at global step 1 usually means: the input, not divergence."""
    if step != 1:
        return ""
    return (
        " At the first step this usually comes from the input, not from training: labels "
        "out of range for the logits (a class id < 0 or >= the number of classes makes "
        "softmax_cross_entropy_with_integer_labels NaN), or NaN/Inf in the features. Check "
        "the labels' range (e.g. labels.min() and labels.max()) in input_fn."
    )


def state_leaf_names(params: Any, collections: Any, opt_state: Any) -> list[str]:
    """Names of the leaves the device flags cover, in their order: variables as
    ``io.variables`` names them (``hidden/kernel``, ``batch_stats/bn/mean``), the optimizer
    state under ``opt_state/`` (``opt_state/0/mu/hidden/kernel``)."""
    tree = (params, collections, opt_state)
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not np.issubdtype(np.dtype(leaf.dtype), np.inexact):
            continue
        part, rest = path[0].idx, path_name(path[1:])
        out.append(rest if part < 2 else f"opt_state/{rest}")
    return out


def check_finite(
    flags: np.ndarray, losses: np.ndarray, steps: np.ndarray, names: list[str]
) -> None:
    """Raises if any step of a loop left a non-finite value in the training state.

    Args:
      flags: ``[n, leaves]`` bools from the device, True where a leaf is all finite.
      losses: ``[n]`` losses of the loop.
      steps: ``[n]`` global steps of the loop.
      names: the leaves' names (``state_leaf_names``).

    Raises:
      NanLossDuringTrainingError: naming the first non-finite step and what was non-finite.
    """
    flags = np.asarray(flags, bool).reshape(len(steps), -1)
    bad_steps = np.flatnonzero(~flags.all(axis=1))
    if not bad_steps.size:
        return
    i = int(bad_steps[0])
    bad = [names[j] if j < len(names) else f"leaf {j}" for j in np.flatnonzero(~flags[i])]
    loss = float(np.asarray(losses).reshape(len(steps), -1)[i].mean())
    if not np.isfinite(loss):
        bad.insert(0, "loss")
    more = f" and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
    step = int(steps[i])
    raise NanLossDuringTrainingError(
        f"NaN or Inf in the training state at global step {step} "
        f"(non-finite: {', '.join(bad[:_SHOWN])}{more}; loss = {loss}). Training stopped "
        "before saving it: no checkpoint holds a non-finite value, the newest one is the "
        f"last finite state.{first_step_hint(step) if 'loss' in bad else ''}",
        global_step=step,
    )
