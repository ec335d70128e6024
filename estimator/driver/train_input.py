"""The training input of one ``train`` call, opened where a checkpoint left it.

A resumed call must see the batches after those its checkpoint consumed, or training would
not be bitwise what an uninterrupted run gives. An iterator with ``get_state``/``set_state``
is restored to the state the checkpoint saved; any other (deterministic) input_fn is
fast-forwarded by the saved number of pulls (``io/input_position.resume_pulls``). The loops
are staged ahead on a thread (``Feeder.prefetch``), as many steps as the step budget hands
out; the first chunk is read at once, since restoring and compiling need its shapes.

Example:
  >>> source = TrainInput(job, input_fn)
  >>> if source.open(meta, budget.next_loop):  # False: it ended while skipping
  ...     first = source.take_first()
  >>> source.close()
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax

from ..core.errors import EstimatorValueError
from ..core.spec import ModeKeys
from ..data.inputs import Chunk
from ..io.input_position import resume_pulls
from . import goodput, preemption
from .job import Job

log = logging.getLogger("estimator")


class TrainInput:
    """The train input_fn's chunks, positioned after the batches a checkpoint consumed.

    Args:
      job: the estimator's collaborators (the feeder, the store, the config).
      input_fn: the user's train ``input_fn``.

    Attributes:
      first: the first chunk, read by ``open``; held until ``take_first`` hands it on.
      model_batch: the rows model_fn sees per replica (from the first chunk).
    """

    def __init__(self, job: Job, input_fn: Callable):
        self.job, self.input_fn = job, input_fn
        self.prefetch = None
        self.first: Chunk | None = None
        self.model_batch = 0

    def open(self, meta: dict, schedule: Callable[[], int]) -> bool:
        """Opens the input after the batches ``meta`` (a checkpoint's; {} for a fresh start)
        says were consumed and reads its first chunk; False when the input ended (or a stop
        came) while skipping them. ``schedule()`` gives each loop's steps (the budget's
        ``next_loop``).

        Raises:
          EstimatorValueError: input_fn produced no batch at all.
        """
        job = self.job
        pipe = job.feeder.pipeline(self.input_fn, ModeKeys.TRAIN, pad=False)
        skip = self._resume(pipe, meta)
        pipe.global_step = int(meta.get("global_step", 0))
        signals = preemption.active()  # a stop request ends a wait for input
        interrupt = None if signals is None else signals.event
        policy = job.feeder.layout(ModeKeys.TRAIN).loop_policy(unrolled=True)  # never merged
        self.prefetch = job.feeder.prefetch(pipe, schedule, policy, skip=skip, interrupt=interrupt)
        with goodput.phase("input_wait"):
            self.first = next(self.prefetch, None)
        if self.first is not None:
            features = self.first.features
            self.model_batch = jax.tree.leaves(features)[0].shape[1] // job.num_replicas
            job.model.check_labels(pipe.has_labels)
            return True
        self.close()
        if interrupt is not None and interrupt.is_set():
            return False
        if skip:
            log.warning("Input ended: nothing left to train after %d consumed batches.", skip)
            return False
        raise EstimatorValueError("input_fn produced no training batches")

    def _resume(self, pipe, meta: dict) -> int:
        """Positions ``pipe`` at ``meta``'s saved iterator state, or returns how many batches
        to skip to get there (0 for a fresh start)."""
        job = self.job
        resume = job.config.resume_input_position
        skip = 0
        saved = meta.get("input_state")
        if meta.get("input_states") is not None:  # a many-process run: this process's position
            saved = meta["input_states"][jax.process_index()]
        if resume and meta:  # bounded: a crafted count must not fast-forward for ever
            path = job.store.writer().path(int(meta.get("global_step", 0)))
            skip = resume_pulls(
                meta,
                pulls_per_step=pipe.pulls_per_step,
                rows_per_pull=pipe.rows_per_pull,
                path=path,
                stateful=pipe.stateful and saved is not None,
                processes=job.feeder.layout(ModeKeys.TRAIN).input_processes,
            )
        if resume and pipe.stateful and saved is not None:
            pipe.set_state(saved)
            skip = 0
        return skip

    def take_first(self) -> Chunk | None:
        """The first chunk, no longer held here: it goes once its call is dispatched."""
        first, self.first = self.first, None
        return first

    def close(self) -> None:
        """Stops the staging thread and drops the first chunk if still held (again: a no-op)."""
        self.first = None
        if self.prefetch is not None:
            self.prefetch.close()
            self.prefetch = None
