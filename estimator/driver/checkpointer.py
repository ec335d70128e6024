"""Training checkpoints: at the configured cadence, at the end, and first on a stop request.

The checkpointer is handed what to save (``Trained``: the step reached, the state after it
and the input position), as Levanter's checkpointer is fed a ``StepInfo``: it holds no
reference to the training run, so it can be driven with a tuple.

Example:
  >>> saver = Checkpointer(config, store.writer(), store, session, last_step=None)
  >>> saver.maybe_save(Trained(step, state, Position(input_pulls=step)))  # after a loop
  >>> saver.save(trained)  # at the end; a step already saved is not written again
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

from ..cluster import progress
from ..core.config import RunConfig
from ..engine.loops import TrainState
from ..engine.state import train_state_parts
from ..io.checkpoint import Checkpoints
from ..io.input_position import PROCESSES_KEY, ROWS_KEY
from ..io.store import LastState, StateStore
from ..parallel import multihost
from . import goodput, goodput_record, preemption
from .hook_runner import Session
from .host import HostWorker

log = logging.getLogger("estimator")


class Position(NamedTuple):
    """Where the training input stands: batches consumed, and the iterator's own state."""

    input_pulls: int = 0
    input_state: Any = None

    @classmethod
    def after(cls, meta: dict) -> Position:
        """The position a checkpoint's meta (``Checkpointer.meta``) recorded; {}: the start."""
        return cls(int(meta.get("input_pulls", 0)), meta.get("input_state"))


class Trained(NamedTuple):
    """What a training loop hands on, and what a checkpoint holds: the global step reached,
    the state after it and the input position after it."""

    step: int
    state: TrainState | None  # None only before the state is restored
    position: Position


class Checkpointer:
    """Writes checkpoints at the configured cadence and at the end; never twice a step.

    ``listeners`` (``CheckpointSaverListener``s, e.g. train_and_evaluate's evaluation) are
    called around each save; while their ``after_save`` runs, the store's last state is the
    one just saved, so an evaluation reads it without reloading. One returning True asks
    training to stop (``stop_requested``).

    Args:
      config: the cadence (``save_checkpoints_steps``, ``save_checkpoints_secs``).
      ckpts: the model_dir's checkpoint writer.
      store: where the saved state is remembered while the listeners' ``after_save`` runs.
      session: what the listeners are given.
      listeners: ``CheckpointSaverListener``s.
      last_step: the step of the newest checkpoint already written (None: none); the
        cadence counts from it and it is not written again.
      pulls_per_step, rows_per_pull, input_processes: the input layout the meta records, so
        a resume can convert the position.
    """

    def __init__(
        self,
        config: RunConfig,
        ckpts: Checkpoints,
        store: StateStore,
        session: Session,
        listeners=(),
        *,
        last_step: int | None,
        pulls_per_step: int = 1,
        rows_per_pull: int | None = None,
        input_processes: int = 1,
    ):
        self.input_processes = input_processes
        self.ckpts, self.store, self.session = ckpts, store, session
        self.listeners = list(listeners)
        self.stop_requested = False
        self.pulls_per_step, self.rows_per_pull = pulls_per_step, rows_per_pull
        self.every_steps = config.save_checkpoints_steps
        self.every_secs = config.checkpoint_every_secs
        self.last_step = last_step
        self.last_time = time.monotonic()

    def save(self, trained: Trained) -> str | None:
        """Writes ``trained`` as the checkpoint of its step; returns its path."""
        step, state = trained.step, trained.state
        if step == self.last_step:
            return self.ckpts.path(step)
        progress.enter("checkpoint", step)  # a hung write is then named as one
        for listener in self.listeners:
            listener.before_save(self.session, step)
        variables, train = train_state_parts(state)
        meta = self.meta(trained)
        with goodput.phase("checkpoint"):
            self.ckpts.save(step, variables, train, meta)
        goodput_record.saved(step)  # the job's time up to this checkpoint, by part
        log.info("Saving checkpoints for %d into %s.", step, self.ckpts.path(step))
        self.last_step, self.last_time = step, time.monotonic()
        if self.listeners:
            self._after_save(LastState(step, state, meta))
        return self.ckpts.path(step)

    def _after_save(self, saved: LastState) -> None:
        self.store.remember(saved)
        try:
            for listener in self.listeners:
                if listener.after_save(self.session, saved.step):
                    self.stop_requested = True
        finally:
            self.store.forget()  # the state goes on to be donated to the next loop

    def meta(self, trained: Trained) -> dict:
        """The JSON meta of a checkpoint: the step and the input position after it."""
        step, position = trained.step, trained.position
        out = {"global_step": step, "input_pulls": position.input_pulls}
        # Pulls beyond the steps' own: short batches skipped (bounds a resume's fast-forward).
        out["skipped_pulls"] = max(position.input_pulls - step * self.pulls_per_step, 0)
        if self.rows_per_pull:  # a resume with another batch size counts in examples
            out[ROWS_KEY] = self.rows_per_pull
            out[PROCESSES_KEY] = self.input_processes
        if multihost.is_multiprocess():  # one iterator per process: keep every position
            states = multihost.gather_objects(position.input_state)
            if any(s is not None for s in states):
                out["input_states"] = states
        elif position.input_state is not None:
            out["input_state"] = position.input_state
        return out

    def maybe_save(self, trained: Trained) -> None:
        """Saves ``trained`` when the cadence says a checkpoint is due."""
        step = trained.step
        due_steps = self.every_steps and step - (self.last_step or 0) >= self.every_steps
        due_secs = self.every_secs and time.monotonic() - self.last_time >= self.every_secs
        if due_secs:  # clocks differ between processes: save when any process is due
            (due_secs,) = multihost.any_of(due_secs)
        if due_steps or due_secs:
            self.save(trained)


def save_then_drain(saver: Checkpointer, worker: HostWorker, trained: Trained) -> None:
    """On a stop request: the checkpoint first (committed), then host work still queued gets
    ``HOST_DRAIN_SECS``; what is left is skipped with a warning."""
    saver.save(trained)
    saver.ckpts.wait()
    if not worker.drain(timeout=preemption.HOST_DRAIN_SECS):
        skipped = [w for w in worker.cancel() if w is not None]
        if skipped:
            log.warning(
                "Stopping: host_call skipped for steps %d-%d (%d loops still queued after %.0f s).",
                skipped[0][0],
                skipped[-1][1],
                len(skipped),
                preemption.HOST_DRAIN_SECS,
            )
    worker.check()


def wait_committed(ckpts: Checkpoints) -> None:
    """Waits for a checkpoint write in flight, even when a second Ctrl-C lands in the wait
    (an Orbax thread left running at exit prints tracebacks)."""
    try:
        ckpts.wait()
    except KeyboardInterrupt:
        ckpts.wait()
        raise
