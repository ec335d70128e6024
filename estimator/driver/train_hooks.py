"""The estimator's own training hooks: the loss log line and the training summaries.

They are default hooks like TF's ``LoggingTensorHook``/``SummarySaverHook``, so the train
loop has no branch for them. They run before the user's hooks in each ``after_run`` (the NaN
check among those), so a non-finite loss is still logged and written first.
"""

from __future__ import annotations

import logging
import time

import numpy as np

import hooks
from hooks import SessionRunArgs, SessionRunContext, SessionRunHook, SessionRunValues

from .. import summary
from ..errors import NanLossDuringTrainingError

log = logging.getLogger("estimator")


class NanLossHook(hooks.NanTensorHook):
    """The default ``NanTensorHook``; raises ``estimator.NanLossDuringTrainingError`` (also a
    ``hooks.NanLossDuringTrainingError``), so ``except estimator.EstimatorError`` catches it."""

    error = NanLossDuringTrainingError


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
