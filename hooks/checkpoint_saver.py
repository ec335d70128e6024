"""``CheckpointSaverHook`` and ``CheckpointSaverListener``: extra checkpoints on a cadence.

Example:
  >>> import os, tempfile
  >>> class Session:  # what the estimator passes; here a stand-in
  ...     global_step, model_dir, mode = 0, tempfile.gettempdir(), "train"
  ...     def save(self, step=None):
  ...         return os.path.join(self.model_dir, f"ckpt-{step}")
  >>> class PrintListener(CheckpointSaverListener):
  ...     def after_save(self, session, global_step):
  ...         print("saved", global_step)
  >>> hook = CheckpointSaverHook(Session.model_dir, save_steps=4, listeners=[PrintListener()])
  >>> session = Session()
  >>> hook.begin(); hook.after_create_session(session, None)
  >>> from hooks.base import SessionRunContext, SessionRunValues
  >>> for loop in range(3):  # loops of 3 steps
  ...     session.global_step += 3
  ...     ctx = SessionRunContext(None, session, steps=range(3 * loop + 1, 3 * loop + 4))
  ...     hook.after_run(ctx, SessionRunValues(None))
  saved 6
  >>> hook.end(session)
  saved 9
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from hooks import _util
from hooks.base import HookSession, SessionRunContext, SessionRunHook, SessionRunValues
from hooks.timer import SecondOrStepTimer


class CheckpointSaverListener:
    """Callbacks around the saves of a ``CheckpointSaverHook`` (all no-ops by default)."""

    def begin(self) -> None:
        """Called once, from the hook's ``begin``."""

    def before_save(self, session: HookSession, global_step_value: int) -> None:
        """Called before each save."""

    def after_save(self, session: HookSession, global_step_value: int) -> bool | None:
        """Called after each save; returning True requests that training stop."""

    def end(self, session: HookSession, global_step_value: int) -> None:
        """Called once at the end, after the final save."""


class CheckpointSaverHook(SessionRunHook):
    """Saves checkpoints every N steps or N seconds, and at the end.

    Saves happen at loop boundaries: at the first boundary whose global step is at least
    ``save_steps`` past the previous save (or ``save_secs`` after it), counting from the
    step the session started at, exactly as TF's timer did with ``steps_per_run``. So
    ``save_steps=4`` with loops of 3 steps from step 0 saves at 6, 12, 18, ... Unlike TF,
    nothing is saved when the session is created: the estimator's starting state is
    already restorable (a fresh seeded init, or the checkpoint it was restored from).
    ``end`` saves the final step unless it was just saved.

    Checkpoints are written by the estimator (``session.save(step)``) into its
    ``model_dir``; a ``checkpoint_dir`` elsewhere is only honoured by a custom ``saver``.

    Args:
      checkpoint_dir: where checkpoints go (should be the estimator's ``model_dir``).
      save_secs: save every this many seconds.
      save_steps: save every this many steps (exactly one of the two).
      saver: optional object with ``save(session, save_path, global_step=step) -> path``
        used instead of ``session.save``.
      checkpoint_basename: file prefix given to a custom ``saver`` (``model.ckpt``).
      scaffold: accepted for TF compatibility and ignored (not with ``saver``).
      listeners: ``CheckpointSaverListener`` objects.

    Attributes:
      last_saved_path: the path returned by the most recent save (None before any).

    Raises:
      ValueError: on both ``saver`` and ``scaffold``, or unless exactly one of
        ``save_secs``/``save_steps`` is given.
    """

    def __init__(
        self,
        checkpoint_dir: str,
        save_secs: float | None = None,
        save_steps: int | None = None,
        saver: Any = None,
        checkpoint_basename: str = "model.ckpt",
        scaffold: Any = None,
        listeners: Sequence[CheckpointSaverListener] | None = None,
    ):
        if saver is not None and scaffold is not None:
            raise ValueError("You cannot provide both saver and scaffold.")
        self._timer = SecondOrStepTimer(every_secs=save_secs, every_steps=save_steps)
        self._checkpoint_dir = checkpoint_dir
        self._save_path = os.path.join(checkpoint_dir, checkpoint_basename)
        self._saver = saver
        self._listeners = list(listeners or [])
        self._clock: Callable[[], float] = time.monotonic
        self.last_saved_path: str | None = None

    def begin(self) -> None:
        self._timer.reset()
        for listener in self._listeners:
            listener.begin()

    def after_create_session(self, session: HookSession, coord: Any) -> None:
        model_dir = getattr(session, "model_dir", None)
        if self._saver is None and model_dir and not _same_dir(model_dir, self._checkpoint_dir):
            _util.logger.warning(
                "CheckpointSaverHook: checkpoint_dir %s is not the estimator's model_dir %s; "
                "checkpoints are written to the model_dir.",
                self._checkpoint_dir,
                model_dir,
            )
        # The starting step is the baseline of the cadence.
        self._timer.update_last_triggered_step(int(session.global_step), self._clock())

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        step = _util.loop_end_step(run_context, None)
        if step is None:
            return
        now = self._clock()
        if self._timer.should_trigger_for_step(step, now):
            self._timer.update_last_triggered_step(step, now)
            if self._save(run_context.session, step):
                run_context.request_stop()

    def end(self, session: HookSession) -> None:
        step = int(session.global_step)
        if step != self._timer.last_triggered_step():
            self._save(session, step)
        for listener in self._listeners:
            listener.end(session, step)

    def _save(self, session: HookSession, step: int) -> bool:
        """Saves at ``step``; returns True if a listener asked to stop training."""
        _util.logger.info("Calling checkpoint listeners before saving checkpoint %d...", step)
        for listener in self._listeners:
            listener.before_save(session, step)
        _util.logger.info("Saving checkpoints for %d into %s.", step, self._save_path)
        if self._saver is not None:
            self.last_saved_path = self._saver.save(session, self._save_path, global_step=step)
        else:
            self.last_saved_path = session.save(step)
        _util.logger.info("Calling checkpoint listeners after saving checkpoint %d...", step)
        should_stop = False
        for listener in self._listeners:
            if listener.after_save(session, step):
                _util.logger.info(
                    "A CheckpointSaverListener requested that training be stopped. listener: %s",
                    listener,
                )
                should_stop = True
        return should_stop


def _same_dir(a: str, b: str) -> bool:
    if "://" in str(a) or "://" in str(b):  # URLs (gs://...) are never local paths
        return str(a).rstrip("/") == str(b).rstrip("/")
    return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))
