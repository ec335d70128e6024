"""``NanTensorHook``: fail (or stop) as soon as the loss is NaN or infinite.

Example:
  >>> import numpy as np
  >>> from hooks.base import SessionRunContext, SessionRunValues
  >>> hook = NanTensorHook("loss")
  >>> ctx = SessionRunContext(None, None, steps=[7, 8, 9])
  >>> hook.after_run(ctx, SessionRunValues(np.array([0.5, np.nan, np.inf])))
  Traceback (most recent call last):
  ...
  hooks.base.NanLossDuringTrainingError: NaN loss during training at global step 8 (loss = nan).
"""

from __future__ import annotations

import numpy as np

from hooks import _util
from hooks.base import (
    NanLossDuringTrainingError,
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)


class NanTensorHook(SessionRunHook):
    """Checks EVERY step's loss, not only the loop's last one (as TF did on TPU).

    The estimator calls ``after_run`` before it saves a checkpoint, so raising here keeps a
    diverged state out of ``model_dir``.

    Args:
      loss_tensor: name of the fetched loss (``"loss"``; any per-step fetch name works, and
        for ``[n, ...]`` values every element of a step is checked).
      fail_on_nan_loss: raise ``NanLossDuringTrainingError`` naming the first bad global
        step; if False, log an error and request a stop instead.

    Attributes:
      nan_step: the first bad step seen, or ``None``.
    """

    error: type[NanLossDuringTrainingError] = NanLossDuringTrainingError  # what it raises

    def __init__(self, loss_tensor: str = "loss", fail_on_nan_loss: bool = True):
        self._loss_tensor = loss_tensor
        self._fail_on_nan_loss = fail_on_nan_loss
        self.nan_step: int | None = None

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs:
        return SessionRunArgs(self._loss_tensor)

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        loss = np.asarray(run_values.results)
        if loss.ndim == 0:
            loss = loss.reshape(1)
        finite = np.isfinite(loss.reshape(loss.shape[0], -1)).all(axis=1)
        if finite.all():
            return
        first = int(np.argmin(finite))
        steps = run_context.steps
        if len(steps) == len(finite):
            self.nan_step = int(steps[first])
        else:  # no per-step counters: the loop ends at the session's step
            end = _util.loop_end_step(run_context, None)
            self.nan_step = None if end is None else end - (len(finite) - 1 - first)
        where = "" if self.nan_step is None else f" at global step {self.nan_step}"
        value = loss[first] if loss.ndim == 1 else "non-finite"
        message = f"NaN loss during training{where} (loss = {value})."
        if self._fail_on_nan_loss:
            raise self.error(message, global_step=self.nan_step)
        _util.logger.error("Model diverged with loss = NaN%s; requesting stop.", where)
        run_context.request_stop()
