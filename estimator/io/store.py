"""Where the training state lives between calls: checkpoints, plus the last state in memory.

``StateStore`` owns the estimator's checkpoint manager (one writer per model_dir, made on the
first ``train``) and remembers the state the last ``train`` left (``LastState``), which equals
its final checkpoint: a following ``train``, ``evaluate`` or ``predict`` uses it instead of
reading the checkpoint back.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .. import storage
from . import checkpoint as ckpt_lib


class LastState(NamedTuple):
    """The state the last ``train`` left in memory, equal to its final checkpoint."""

    step: int
    state: Any  # engine.loops.TrainState
    meta: dict  # the checkpoint's JSON meta (global step, input position)


class StateStore:
    """Checkpoints of one model_dir and the last in-memory training state.

    Args:
      model_dir: the estimator's model directory.
      keep_checkpoint_max: how many checkpoints the writer keeps.

    Example:
      >>> store = StateStore("/tmp/run", keep_checkpoint_max=5)
      >>> store.writer().save(step, variables, train, meta)
      >>> store.remember(LastState(step, state, meta))
    """

    def __init__(self, model_dir: str, *, keep_checkpoint_max: int | None):
        self.model_dir = model_dir
        self._keep = keep_checkpoint_max
        self._writer: ckpt_lib.Checkpoints | None = None
        self._last: LastState | None = None
        # Evaluate's or predict's variables of one checkpoint, placed for their loops
        # (``io/restore.py: Placed``): the next call of the same checkpoint reuses them.
        self.placed: Any = None

    def writer(self) -> ckpt_lib.Checkpoints:
        """The one checkpoint writer of this model_dir (created on first use)."""
        if self._writer is None:
            self._writer = ckpt_lib.Checkpoints(self.model_dir, max_to_keep=self._keep)
        return self._writer

    def reader(self, model_dir: str | None = None) -> ckpt_lib.Checkpoints:
        """Checkpoints to read: the writer for our own model_dir (after its pending writes),
        a read-only manager for another directory."""
        if model_dir is None or self.owns(model_dir):
            if self._writer is not None:
                self._writer.wait()
                return self._writer
            model_dir = self.model_dir
        return ckpt_lib.Checkpoints(model_dir, read_only=True)

    def owns(self, model_dir: str) -> bool:
        return storage.absolute(model_dir) == storage.absolute(self.model_dir)

    @property
    def last(self) -> LastState | None:
        return self._last

    def remember(self, last: LastState) -> None:
        self._last = last

    def forget(self) -> None:
        """Drops the in-memory state (it is about to be donated to a compiled loop), and the
        variables evaluate kept: training needs the memory, and the next checkpoint differs."""
        self._last = None
        self.placed = None

    def latest_checkpoint(self) -> str | None:
        """The directory of the newest complete checkpoint, or None."""
        ckpts = self.reader()
        step = ckpts.newest_step()
        return None if step is None else ckpts.path(step)
