"""The all-finite check of the training state: no checkpoint ever holds a NaN or Inf.

Each compiled train call returns one flag per floating-point leaf of the params, the other
collections and the optimizer state it ends with (``engine.loops.finite_flags``): one pass
over the state per call, not per step (docs/performance.md, finding 14). The training loop
checks them as each call is fetched, before hooks run and before anything is saved, so a NaN
that reached the state with a finite loss (a NaN gradient, an optimizer that divides by
zero) stops training with ``NanLossDuringTrainingError`` naming the first non-finite step
and what was non-finite; the newest checkpoint stays the last finite state.

Only on failure is the step found (``FiniteGuard``): the call is replayed from its input
state, which the program kept (``Programs.train``), with per-step flags. With non-finite
steps skipped no replay is needed: every step keeps a finite state finite, so it was the
state the call started from. Where keeping the input state is not cheap, the program
returns per-step flags instead, as every call once did. A value that turns non-finite and
is overwritten again within one call (a collection replaced every step) is not reported:
what is checked is what a checkpoint could hold.

Example:
  >>> names = state_leaf_names(state.params, state.state, state.opt_state)  # once per call
  >>> guard = FiniteGuard(names, per_step=False, replay_loop=lambda: per_step_program)
  >>> guard.check(flags, losses, steps, source)  # after every compiled call
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from ..core.errors import NanLossDuringTrainingError
from ..io.variables import path_name
from ..parallel import multihost

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


class Replay(NamedTuple):
    """What a train call started from: its input state (kept, not donated) and batches."""

    state: Any
    features: Any
    labels: Any


class FiniteGuard:
    """Checks each train call's all-finite flags; on failure names the first bad step.

    Args:
      names: the leaves' names (``state_leaf_names``).
      per_step: the flags are ``[n, leaves]``, one row per step; otherwise ``[leaves]`` of
        the state the call returned (``Programs.train(per_step_flags=...)``).
      replay_loop: ``() -> loop`` the per-step program (it donates what it is given), to
        rerun a failed call from its kept input; None where non-finite steps are skipped.
    """

    def __init__(self, names: list[str], *, per_step: bool, replay_loop: Callable[[], Any] | None):
        self.names, self.per_step, self.replay_loop = names, per_step, replay_loop

    def keeps(self, steps: int) -> bool:
        """Whether a call of ``steps`` steps must keep its input (``Replay``) for a replay."""
        return self.keeps_any() and steps > 1

    def keeps_any(self) -> bool:
        """Whether calls (of more than one step) keep their input for a replay."""
        return not self.per_step and self.replay_loop is not None

    def check(self, flags, losses, steps: np.ndarray, source: Replay | None) -> None:
        """Raises ``NanLossDuringTrainingError`` if the call left a non-finite state.

        ``steps`` are the call's global steps; ``source`` its kept input (``keeps``).
        """
        if self.per_step:
            check_finite(flags, losses, steps, self.names)
            return
        flags = np.asarray(flags, bool).reshape(-1)
        if flags.all():
            return
        if source is not None:
            _, (losses, _, per_step) = self.replay_loop()(*source)
            del source  # donated to the replay
            losses, per_step = multihost.to_host((losses, per_step))
            check_finite(per_step, losses, steps, self.names)
            _not_reproduced(flags, steps, self.names)
        # One step, or non-finite steps skipped (a finite state stays finite, so the state
        # the call started from was not): the call's first step.
        check_finite(np.tile(flags, (len(steps), 1)), losses, steps, self.names)


def _not_reproduced(flags: np.ndarray, steps: np.ndarray, names: list[str]) -> None:
    """Raises for a call whose result was non-finite while its replay stayed finite."""
    bad = [names[j] if j < len(names) else f"leaf {j}" for j in np.flatnonzero(~flags)]
    first, last = int(steps[0]), int(steps[-1])
    raise NanLossDuringTrainingError(
        f"NaN or Inf in the training state after global step {last} (non-finite: "
        f"{', '.join(bad[:_SHOWN])}); replaying steps {first}-{last} from the state before "
        "them did not reproduce it, so the first non-finite step is not known. Training "
        "stopped before saving it: no checkpoint holds a non-finite value.",
        global_step=last,
    )
