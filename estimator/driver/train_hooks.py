"""The estimator's own training hooks: the loss log line and the training summaries (loss,
speed, and the injected hyperparameters of the train_op).

They are default hooks like TF's ``LoggingTensorHook``/``SummarySaverHook``, so the train
loop has no branch for them. They run before the user's hooks in each ``after_run`` (the NaN
check among those), so a non-finite loss is still logged and written first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import hooks
from hooks import SessionRunArgs, SessionRunContext, SessionRunHook, SessionRunValues

from ..core import summary
from ..core.errors import NanLossDuringTrainingError
from ..io import variables as variables_lib
from . import nonfinite, optimizer_info

log = logging.getLogger("estimator")


class NanLossHook(hooks.NanTensorHook):
    """The default ``NanTensorHook``; raises ``estimator.NanLossDuringTrainingError`` (also a
    ``hooks.NanLossDuringTrainingError``), so ``except estimator.EstimatorError`` catches it.
    At global step 1 the error adds where such a loss usually comes from (labels out of
    range for the logits)."""

    @staticmethod
    def error(message: str, *, global_step: int | None = None) -> NanLossDuringTrainingError:
        hint = nonfinite.first_step_hint(global_step)
        return NanLossDuringTrainingError(message + hint, global_step=global_step)


class LossLoggingHook(SessionRunHook):
    """Logs ``loss = L, step = S (T sec)`` when a loop crosses a multiple of ``every``.

    ``L`` is the mean loss over the loop's steps, ``T`` the time since the previous line.
    """

    def __init__(self, every: int):
        self.every = every
        self._last = time.monotonic()

    def begin(self) -> None:
        self._last = time.monotonic()

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        return SessionRunArgs({"loss": "loss", "step": "global_step"})

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        losses, steps = run_values.results["loss"], run_values.results["step"]
        if not any(int(s) % self.every == 0 for s in steps):
            return
        now = time.monotonic()
        log.info(
            "loss = %.4g, step = %d (%.3f sec)",
            float(np.mean(losses)),
            int(steps[-1]),
            now - self._last,
        )
        self._last = now


class TrainSummaryHook(SessionRunHook):
    """Writes ``loss`` (and ``nonfinite_steps``, and float16's ``loss_scale``) every
    ``every`` steps and the speed scalars; see ``summary.TrainSummaries`` for the cadence."""

    NONFINITE = "nonfinite_steps"
    LOSS_SCALE = "loss_scale"

    def __init__(
        self,
        writer,
        *,
        every: int,
        examples_per_step: int,
        nonfinite: bool,
        loss_scale: bool = False,
    ):
        self._summaries = summary.TrainSummaries(
            writer, every=every, examples_per_step=examples_per_step
        )
        self._nonfinite = nonfinite
        self._loss_scale = loss_scale

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        fetches = {"loss": "loss", "step": "global_step"}
        if self._nonfinite:
            fetches["nonfinite"] = self.NONFINITE
        if self._loss_scale:
            fetches["loss_scale"] = self.LOSS_SCALE
        return SessionRunArgs(fetches)

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        got = run_values.results
        nonfinite = int(np.asarray(got["nonfinite"]).reshape(-1)[-1]) if self._nonfinite else None
        scale = float(np.asarray(got["loss_scale"]).reshape(-1)[-1]) if self._loss_scale else None
        self._summaries.after_loop(got["loss"], got["step"], nonfinite, loss_scale=scale)


def _is_injected(x: Any) -> bool:
    """An ``optax.inject_hyperparams`` state (``InjectHyperparamsState`` or the stateful one)."""
    return isinstance(getattr(x, "hyperparams", None), dict) and hasattr(x, "inner_state")


def _scalar(x: Any) -> float | None:
    if isinstance(x, jax.Array):
        if x.size != 1 or not jnp.issubdtype(x.dtype, jnp.number):
            return None
        x = x.addressable_shards[0].data  # replicated: any process's own copy
    value = np.asarray(x)
    if value.size != 1 or not np.issubdtype(value.dtype, np.number):
        return None
    return float(value.reshape(()))


def injected_hyperparams(opt_state: Any) -> dict[str, Any]:
    """``{name: array}`` of every scalar hyperparameter that ``optax.inject_hyperparams``
    keeps in ``opt_state``, found wherever it is (inside ``chain``, ``ExponentialMovingAverage
    .apply``, ...). Names are the hyperparameters' own (``learning_rate``); when several
    injected optimizers are found, each name is prefixed by its path in the state.

    Example:
      >>> injected_hyperparams(optax.inject_hyperparams(optax.sgd)(0.1).init(params))
      {'learning_rate': Array(0.1, dtype=float32)}
    """
    nodes = [
        (path, node)
        for path, node in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_injected)[0]
        if _is_injected(node)
    ]
    out = {}
    for path, node in nodes:
        prefix = f"{variables_lib.path_name(path)}/" if len(nodes) > 1 else ""
        for name, value in node.hyperparams.items():
            if getattr(value, "size", 1) == 1 and hasattr(value, "dtype"):
                out[prefix + str(name)] = value
    return out


_UNREADABLE_SAID: set[str] = set()  # optimizers whose unreadable rate was said (per process)


class HyperparamSummaryHook(SessionRunHook):
    """Writes the train_op's learning rate and injected hyperparameters as scalars.

    ``optax.inject_hyperparams`` keeps each hyperparameter's value of the latest update in the
    optimizer state, so no user code (host_call) is needed: after each loop that crosses a
    multiple of ``every`` steps, the values are written at the loop's last step (the values
    that step used; with ``iterations_per_loop=1`` exactly every ``every`` steps). Any other
    optax optimizer's ``learning_rate`` is read from its step sizes (``optimizer_info``: a
    constant, or a schedule evaluated on the host at the count of that step's update); where
    it cannot be read, one INFO line says how to have it written.

    Args:
      writer: a tensorboardX writer, or None (writes nothing).
      every: ``RunConfig.save_summary_steps``; 0 or None writes nothing.
      opt_state: returns the optimizer state after the loop (read before the next loop).
      train_op: the spec's optax optimizer (None: only injected hyperparameters).
    """

    LEARNING_RATE = "learning_rate"

    def __init__(
        self, writer, *, every: int | None, opt_state: Callable[[], Any], train_op: Any = None
    ):
        self._writer, self._every, self._opt_state = writer, every or 0, opt_state
        self._train_op = train_op
        self._rate: optimizer_info.LearningRate | None = None

    def begin(self) -> None:
        if self._writer is None or not self._every or self._train_op is None:
            return
        injected = injected_hyperparams(self._opt_state())
        if any(name.endswith(self.LEARNING_RATE) for name in injected):
            return  # optax keeps it: written with the other injected values
        self._rate = optimizer_info.learning_rate_fn(self._train_op)
        name = optimizer_info.optimizer_name(self._train_op)
        if self._rate is None and name not in _UNREADABLE_SAID:  # once, not per train call
            _UNREADABLE_SAID.add(name)
            log.info(
                "The learning rate is not written to TensorBoard: it cannot be read from this "
                "train_op (%s). Build it with optax.inject_hyperparams, e.g. "
                "optax.inject_hyperparams(optax.adam)(learning_rate=schedule), to have it "
                "written.",
                name,
            )

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        return SessionRunArgs("global_step")

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        steps = np.asarray(run_values.results).reshape(-1)
        if self._writer is None or not self._every or not len(steps):
            return
        if not any(int(s) % self._every == 0 for s in steps):
            return
        opt_state = self._opt_state()
        for name, value in injected_hyperparams(opt_state).items():
            scalar = _scalar(value)
            if scalar is not None:
                self._writer.add_scalar(name, scalar, global_step=int(steps[-1]))
        if self._rate is not None:
            self._write_rate(opt_state, int(steps[-1]))

    def _write_rate(self, opt_state: Any, step: int) -> None:
        """The rate of the update that made ``step``: the schedule's count of that update
        (the state's count after it, less one), else ``step - 1``."""
        count = optimizer_info.schedule_count(opt_state)
        count = step - 1 if count is None else count - 1
        try:
            rate = self._rate.at(max(count, 0))
        except Exception as e:  # noqa: BLE001 (a schedule that fails on the host: not written)
            log.info(
                "The learning rate is not written to TensorBoard: its schedule failed on "
                "the host (%s: %s).",
                type(e).__name__,
                e,
            )
            self._rate = None
            return
        self._writer.add_scalar(self.LEARNING_RATE, rate, global_step=step)
