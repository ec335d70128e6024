"""The training loop: short and linear; logging, summaries and checkpoints attach around it.

One ``train`` call is a ``TrainRun`` in named phases: open the input (positioned where the
checkpoint left it), restore the state, assemble the hooks, loop, finish. One ``StepBudget``
(``budget.py``) says where it ends: the input schedule stages the loops it allows and the loop
stops when it is reached; ``TrainOutcome.reason`` says why it ended, in one log line.

One iteration (a loop of ``iterations_per_loop`` steps): hooks' before_run -> the loop's
compiled calls back to back (one, or several when its input exceeds
``max_staged_input_bytes``; ``dispatch``) -> its per-step outputs on the host -> host_call
and summaries on the host thread -> hooks' after_run (the NaN check among them) -> maybe
checkpoint. The next call's input is already on the devices.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import numpy as np

import hooks as hooks_lib

from .. import summary
from ..cluster import progress as cluster_progress
from ..config import RunConfig
from ..data.inputs import Chunk
from ..engine import precision
from ..engine.loops import TrainState
from ..engine.state import fresh_train_state
from ..errors import EstimatorTypeError, EstimatorValueError
from ..io import disk_full, lease
from ..io.input_position import resume_pulls
from ..io.lock import TrainerLock
from ..io.restore import restore_train_state
from ..io.store import LastState
from ..parallel import multihost
from ..scaffold import IN_MODEL_FN, fresh_init_fn
from ..spec import ModeKeys
from . import (
    auto_loop,
    dispatch,
    goodput,
    goodput_record,
    hparams,
    nonfinite,
    preemption,
    progress,
    throughput,
)
from .budget import StepBudget, log_end, planned_last_steps
from .checkpointer import Checkpointer, save_then_drain, wait_committed
from .hook_runner import HookRunner, Session
from .host import HOST_CALL_QUEUE_LOOPS, HostWorker, run_host_calls
from .job import EndReason, Job, TrainOutcome
from .preemption import StopSignals
from .train_hooks import HyperparamSummaryHook, LossLoggingHook, NanLossHook, TrainSummaryHook

log = logging.getLogger("estimator")


@dataclasses.dataclass
class _Position:
    """Where the training input stands: batches consumed, and the iterator's own state."""

    input_pulls: int = 0
    input_state: Any = None


def run_train_loops(
    job: Job, input_fn, *, hooks, steps, max_steps, warm_start_from=None, saving_listeners=()
) -> TrainOutcome:
    """Trains until ``steps`` more, ``max_steps`` in all, a hook's stop or the input's end;
    ``saving_listeners`` (``CheckpointSaverListener``) are called around every checkpoint.

    Raises:
      ModelDirInUseError: another trainer holds the model_dir (see ``io/lock.py``).
    """
    run = TrainRun(
        job,
        input_fn,
        hooks=hooks,
        steps=steps,
        max_steps=max_steps,
        warm_start_from=warm_start_from,
        saving_listeners=saving_listeners,
    )
    return run.run()


class TrainRun:
    """One ``train`` call: open input -> restore -> hooks -> loop -> finish.

    It owns the call's mutable state: the ``TrainState`` (donated to each loop and replaced
    by its result), the input position, the step budget and the step reached.
    """

    def __init__(
        self, job: Job, input_fn, *, hooks, steps, max_steps, warm_start_from, saving_listeners
    ):
        self.job, self.input_fn = job, input_fn
        self.user_hooks = list(hooks or ())
        self.steps, self.max_steps = steps, max_steps
        self.warm_start_from = warm_start_from
        self.listeners = _checked_listeners(saving_listeners)  # checked before any work
        self.state: TrainState | None = None
        self.position = _Position()
        self.budget: StepBudget | None = None
        self.step = 0
        self.losses: np.ndarray | None = None  # the last loop's
        self.pipe = self.prefetch = None
        self.first: Chunk | None = None  # handed to the loop once, then not held
        self.model_batch = 0  # rows model_fn sees per replica
        self.startup: progress.Startup | None = None
        self.writer = self.saver = self.session = None  # made with the hooks

    # ------------------------------------------------------------------ the call
    def run(self) -> TrainOutcome:
        called = time.monotonic()
        cluster_progress.enter("startup")  # the stall watchdog names each phase it stalls in
        lock = lease.for_model_dir(self.job.model_dir)  # one trainer; process 0 holds it
        multihost.run_on_process_0(
            lambda: _acquire(lock, self.job.model_dir), f"locking model_dir {self.job.model_dir}"
        )
        self.startup = progress.Startup(since=called)
        self.goodput = goodput.Goodput(since=called, model_dir=self.job.model_dir)
        try:
            with goodput.active(self.goodput):
                return self._run_locked()
        finally:
            self.startup.close()
            lock.release()
            goodput_record.write(self.goodput, self.step)  # the next run counts what is lost

    def _run_locked(self) -> TrainOutcome:
        with goodput.phase("checkpoint"):
            latest = self._latest()
        start = latest[0] if latest else 0
        self.budget = self._budget(start)
        if self.budget.reached(start):
            outcome = TrainOutcome(start, EndReason.ALREADY_DONE)
            log_end(outcome, self.budget)
            return outcome
        with StopSignals() as signals:
            try:
                outcome = self._train(latest, signals)
            finally:
                self._close_input()
        if signals.requested:  # SIGTERM or Ctrl-C: the checkpoint of the step is committed
            outcome = outcome._replace(reason=EndReason.SIGNAL)
        log_end(outcome, self.budget, signal=signals.reason)
        if signals.requested:
            ckpts = self.job.store.writer()
            path = ckpts.path(outcome.step) if outcome.step in ckpts.steps() else None
            raise signals.stop_error(outcome.step, path).with_traceback(None) from None
        return outcome

    def _train(self, latest, signals: StopSignals) -> TrainOutcome:
        meta = latest[1] if latest else {}
        if not (self.open_input(meta) and self.restore(meta)):
            reason = EndReason.SIGNAL if signals.requested else EndReason.INPUT_END
            return TrainOutcome(latest[0] if latest else 0, reason)
        _check_loss_dtype(self.job.programs.spec(ModeKeys.TRAIN))
        goodput_record.resume(self.goodput, self.job.model_dir, meta)
        runner = self.hooks()
        worker = HostWorker(max_queued=HOST_CALL_QUEUE_LOOPS)  # the device waits for a slow host
        try:
            reason = self.loop(runner, worker, signals)
            self.finish(runner, worker, signals)
            with goodput.phase("checkpoint"):
                wait_committed(self.saver.ckpts)
            goodput_record.report(self.goodput, self.writer, self.step)
        finally:
            self._close_input()
            worker.close(timeout=0.5 if signals.requested else 30)
            wait_committed(self.saver.ckpts)
            # Closing (not flush) waits for tensorboardX's queue: summaries are on disk.
            summary.close(self.job.model_dir)
            summary.close_file_writers()  # those host_call opened with create_file_writer
        return TrainOutcome(self.step, reason)

    def _latest(self):
        """The newest checkpoint that looks intact, or verified when the call will skip."""
        ckpts = self.job.store.writer()
        latest = ckpts.latest_meta()
        if latest and self._budget(latest[0]).reached(latest[0]):
            latest = ckpts.latest_verified()  # about to skip: its arrays must read back
        return latest

    def _budget(self, start: int) -> StepBudget:
        return StepBudget.of(
            start,
            steps=self.steps,
            max_steps=self.max_steps,
            hook_targets=planned_last_steps(self.user_hooks, start),
            iterations_per_loop=auto_loop.chosen(self.job),
        )

    # ------------------------------------------------------------------ phases
    def open_input(self, meta: dict) -> bool:
        """Opens the input positioned after the batches ``meta`` says were consumed and reads
        its first chunk; False when the input ended (or a stop came) while skipping them.

        An iterator with ``get_state``/``set_state`` is restored to the saved state; otherwise
        a deterministic input_fn is fast-forwarded by the saved number of pulls. The step
        budget is set from the step ``meta`` starts at.
        """
        job = self.job
        resume = job.config.resume_input_position
        pipe = job.feeder.pipeline(self.input_fn, ModeKeys.TRAIN, pad=False)
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
        begin = int(meta.get("global_step", 0))
        self.budget = self._budget(begin)
        pipe.global_step = begin
        signals = preemption.active()  # a stop request ends a wait for input
        interrupt = None if signals is None else signals.event
        self.pipe = pipe
        policy = job.feeder.layout(ModeKeys.TRAIN).loop_policy(unrolled=True)  # never merged
        self.prefetch = job.feeder.prefetch(
            pipe, self.budget.next_loop, policy, skip=skip, interrupt=interrupt
        )
        with goodput.phase("input_wait"):
            self.first = next(self.prefetch, None)
        if self.first is not None:
            return True
        self._close_input()
        if interrupt is not None and interrupt.is_set():
            return False
        if skip:
            log.warning("Input ended: nothing left to train after %d consumed batches.", skip)
            return False
        raise EstimatorValueError("input_fn produced no training batches")

    def restore(self, meta: dict) -> bool:
        """The state: restored from the newest intact checkpoint (the input reopened where an
        older one had to be restored, since ``meta`` was not it), or fresh with the scaffold
        or warm start. False when the reopened input ended while skipping."""
        job, first = self.job, self.first
        self.model_batch = jax.tree.leaves(first.features)[0].shape[1] // job.num_replicas
        job.model.check_labels(self.pipe.has_labels)
        example = (first.features, first.labels)
        with goodput.phase("checkpoint"):
            restored = restore_train_state(job.programs, job.store, example, self.model_batch)
        if restored is None:
            self.state = fresh_train_state(job.programs, example, self.model_batch, self._init_fn)
            return True
        self.state, restored_meta = restored
        if restored_meta.get("global_step") != meta.get("global_step"):
            # The newest checkpoint was damaged and an older one restored: reposition.
            self._close_input()
            self.first = first = example = None
            if not self.open_input(restored_meta):
                return False
        pulls = int(restored_meta.get("input_pulls", 0))
        self.position = _Position(pulls, restored_meta.get("input_state"))
        return True

    def _init_fn(self):
        """The fresh variables, once model_fn was traced (its scaffold_fn is known)."""
        return fresh_init_fn(
            self.job.programs.spec(ModeKeys.TRAIN),
            self.warm_start_from,
            in_model_fn=self.job.model.noted(ModeKeys.TRAIN, IN_MODEL_FN, ()),
        )

    def hooks(self) -> HookRunner:
        """Every hook of the call, assembled here in the order they run: the start-up summary
        (its line comes before the first loss line), the default hooks, model_fn's
        ``training_hooks``, the user's, then the progress bar. Also makes the saver and the
        session hooks see."""
        job, cfg, state = self.job, self.job.config, self.state
        self.step = step = int(jax.device_get(state.step))
        layout = job.feeder.layout(ModeKeys.TRAIN)
        global_batch = layout.global_rows or self.model_batch
        compiled = self._train_program()
        call_steps = jax.tree.leaves(self.first.features)[0].shape[0]  # the first call's
        tuner = auto_loop.tuner_for(job, self.budget, call_steps=call_steps)
        first = progress.StartupSummaryHook(
            job.mesh,
            cfg,
            self.startup,
            global_batch=global_batch,
            replica_batch=self.model_batch,
            params=state.params,
            opt_state=state.opt_state,
            state=state.state,
            start_step=step,
            target=self.budget.target,
            train_program=compiled,
            loop_note=auto_loop.note(job, tuner),
        )
        given = list(job.programs.spec(ModeKeys.TRAIN).training_hooks) + self.user_hooks
        if progress.progress_enabled(cfg.progress_bar):
            given.append(progress.ProgressBarHook(start=step, total=self.budget.target))
        self.writer = summary.writer_for(job.model_dir)
        train_op = job.programs.spec(ModeKeys.TRAIN).train_op
        defaults = _default_hooks(
            cfg,
            given,
            writer=self.writer,
            examples_per_step=global_batch,
            opt_state=lambda: self.state.opt_state,  # after each loop, before the next one
            train_op=train_op,
            flops=throughput.ModelFlops.of(job, compiled, steps=call_steps),
        )
        if step == 0 and cfg.save_summary_steps:  # from scratch: params in the HPARAMS tab
            trainer = hparams.trainer_hparams(
                cfg, global_batch=global_batch, max_steps=self.budget.target, train_op=train_op
            )
            hparams.write_session_start(self.writer, {**trainer, **job.model.params})
        ckpts = job.store.writer()
        self.saver = Checkpointer(
            cfg,
            ckpts,
            self,
            job.store,
            self.listeners,
            pulls_per_step=layout.pulls_per_step,
            rows_per_pull=layout.rows_per_pull,
            input_processes=layout.input_processes,
        )
        self.saver.last_step = step if ckpts.steps() else None
        self.session = Session(
            mode=ModeKeys.TRAIN, model_dir=job.model_dir, global_step=step, save=self.saver.save
        )
        self.saver.session = self.session
        reporting = [goodput_record.GoodputHook(self.goodput)]
        hooks = [*auto_loop.as_list(tuner), first, *defaults, *given, *reporting]
        return HookRunner(hooks, self.session, examples_per_step=global_batch)

    def _train_program(self):
        """() -> the compiled train loop of the first chunk's shapes, the one the loop runs
        (for the DEBUG memory line and the model FLOPs; abstract shapes only, as the state
        is donated to the first loop)."""
        if self.first is None:
            return None

        def abstract(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

        args = jax.tree.map(abstract, (self.state, self.first.features, self.first.labels))
        programs, batch, steps = self.job.programs, self.model_batch, self.first.steps

        def compiled():  # what the calls ran: compiled ahead or loaded, else in jit's cache
            loop = programs.train(batch, per_step_flags=programs.per_step_flags(args[0]))
            return loop.executable(steps) or loop.lower(*args).compile()

        return compiled

    def loop(self, runner: HookRunner, worker: HostWorker, signals: StopSignals) -> EndReason:
        """Runs loops until the budget is reached, a hook or listener stops, the input ends
        or a signal comes; returns which."""
        job, cfg = self.job, self.job.config
        per_step = job.programs.per_step_flags(self.state)
        program = job.programs.train(self.model_batch, per_step_flags=per_step)
        state = self.state
        names = nonfinite.state_leaf_names(state.params, state.state, state.opt_state)
        guard = nonfinite.FiniteGuard(names, per_step=per_step, replay_loop=self._replay_loop())
        runner.begin()
        for listener in self.saver.listeners:
            listener.begin()
        runner.after_create_session()
        first, self.first = self.first, None
        if signals.requested and not multihost.is_multiprocess():
            first = None  # stopped during start-up: save the state as it is
        # A listener that evaluates (train_and_evaluate's) has its eval program compile meanwhile.
        evals = [x.evaluation_steps for x in self.listeners if hasattr(x, "evaluation_steps")]
        if first is not None and evals:
            layout = job.feeder.layout(ModeKeys.EVAL)
            job.programs.compile_eval_ahead(self.state, first, layout, steps=evals[0])
        loops = dispatch.loops_of(self.prefetch, first) if first is not None else iter(())
        loops = cluster_progress.each(loops, "input", then="hooks", step=lambda: self.step)
        del first  # the loop holds it until its call is dispatched
        job.store.forget()  # the state is donated to the loop from here on
        for loop_steps, calls in goodput.each(loops, "input_wait"):
            steps = np.arange(self.step + 1, self.step + loop_steps + 1)
            runner.before_run(steps)
            # each call's state is checked as it is fetched, before anything is saved
            with goodput.phase("productive"):
                losses, host, done = _run_calls(program, self, calls, guard)
            steps = steps[:done]  # fewer when the input ended inside the loop
            self.step += done
            self.losses = losses
            self.session.global_step = self.step
            cluster_progress.enter("host_call", self.step)
            self._host_call(worker, host, steps, signals)
            cluster_progress.enter("hooks")
            hook_stop = runner.after_run(_loop_values(cfg, self.state, losses, steps, host), steps)
            multihost.check_worker(worker, "host_call")
            self.saver.maybe_save(self.step)
            reason = self._stop_reason(hook_stop, signals)
            if reason is not None:
                return reason
        # The input ended (or a stop request ended a wait for it).
        return EndReason.SIGNAL if signals.requested else EndReason.INPUT_END

    def _replay_loop(self):
        """() -> the per-step train program a failed call is replayed with (None when the
        programs keep no input state: non-finite steps are skipped)."""
        programs, batch = self.job.programs, self.model_batch
        if not programs.keeps_train_input():
            return None
        return lambda: programs.train(batch, per_step_flags=True)

    def _host_call(self, worker: HostWorker, host, steps: np.ndarray, signals) -> None:
        """The loop's host_call on the host thread, once, on process 0."""
        host_call = self.job.programs.spec(ModeKeys.TRAIN).host_call
        if host_call is None or not multihost.is_process_0():
            return
        every_n = self.job.config.tpu_config.host_call_every_n_steps
        worker.submit(
            lambda f=host_call[0], h=host, s=steps, w=self.writer: run_host_calls(
                f, h, s, every_n, w
            ),
            what=(int(steps[0]), int(steps[-1])),
            interrupt=signals.event,
        )

    def _stop_reason(self, hook_stop: bool, signals: StopSignals) -> EndReason | None:
        """Why to stop after this loop, agreed by every process (they all stop together)."""
        hook, listener, signal = multihost.any_of(
            hook_stop, self.saver.stop_requested, signals.requested
        )
        if signal:  # SIGTERM or Ctrl-C: checkpoint this step in finish, then stop
            return EndReason.SIGNAL
        if hook:
            return EndReason.HOOK
        if listener:
            return EndReason.LISTENER
        return EndReason.TARGET if self.budget.reached(self.step) else None

    def finish(self, runner: HookRunner, worker: HostWorker, signals: StopSignals) -> None:
        """Hooks' end, the final checkpoint and the listeners' end; on a stop request the
        checkpoint first, with no evaluation or other listener work in the grace period."""
        runner.end()
        step = self.step
        if signals.requested:
            self.saver.listeners = []
            save_then_drain(self.saver, worker, step)
        else:
            cluster_progress.enter("host_call", step)
            multihost.check_worker(worker, "host_call", join=True)
            self.saver.save(step)
            for listener in self.saver.listeners:
                listener.end(self.session, step)
        self.job.store.remember(LastState(step, self.state, self.saver.meta(step)))
        if self.losses is not None:
            log.info("Loss for final step: %.4g.", float(self.losses[-1]))

    def _close_input(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
            self.prefetch = None


def _acquire(lock: TrainerLock, model_dir: str) -> None:
    """Takes the trainer lock: the first write into model_dir, so a full disk is found here
    and named (the lock's own write raises ``ENOSPC`` without a path)."""
    try:
        lock.acquire()
    except OSError as e:
        if disk_full.is_disk_full(e):
            raise disk_full.model_dir_full_error(model_dir, "its lock file") from e
        raise


def _default_hooks(
    config: RunConfig,
    given,
    *,
    writer,
    examples_per_step: int,
    opt_state=lambda: None,
    train_op=None,
    flops: throughput.ModelFlops | None = None,
) -> list:
    """The training summaries (loss, speed, the learning rate and injected hyperparameters
    of the train_op, read through ``opt_state()``) and the loss log line, NanTensorHook
    (unless non-finite steps are skipped, or the user passed their own NanTensorHook, e.g.
    ``fail_on_nan_loss=False``) and the step counter."""
    every = config.log_step_count_steps or 0
    out = [
        TrainSummaryHook(
            writer,
            every=config.save_summary_steps,
            examples_per_step=examples_per_step,
            nonfinite=precision.skips_nonfinite(config),
            loss_scale=precision.uses_loss_scale(config.tpu_config.compute_dtype),
        ),
        HyperparamSummaryHook(
            writer, every=config.save_summary_steps, opt_state=opt_state, train_op=train_op
        ),
    ]
    if flops is not None:  # perf/ scalars every save_summary_steps, one line at the end
        every_summary, batch = config.save_summary_steps, examples_per_step
        out.append(
            throughput.PerfSummaryHook(
                writer, every=every_summary, flops=flops, examples_per_step=batch
            )
        )
    if every:
        out.append(LossLoggingHook(every))
    own_nan = any(isinstance(h, hooks_lib.NanTensorHook) for h in given)
    if not (precision.skips_nonfinite(config) or own_nan):
        out.append(NanLossHook("loss"))
    if every:  # logs speed; the summaries come every save_summary_steps (TrainSummaries)
        if flops is None:
            out.append(hooks_lib.StepCounterHook(every_n_steps=every))
        else:  # the per-device figures follow its lines
            out.append(throughput.PerfStepCounterHook(every_n_steps=every, flops=flops))
    return out


def check_steps(steps, max_steps) -> None:
    """``train``'s ``steps`` and ``max_steps``: at most one, a positive int.

    Raises:
      EstimatorValueError: both given, or not positive.
      EstimatorTypeError: not an int.
    """
    if steps is not None and max_steps is not None:
        raise EstimatorValueError("Can not provide both steps and max_steps.")
    for name, value in (("steps", steps), ("max_steps", max_steps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise EstimatorTypeError(f"{name} must be an int, got {value!r}")
        if value is not None and value <= 0:
            raise EstimatorValueError(f"Must specify {name} > 0, given: {value}")


def _checked_listeners(listeners) -> list:
    """``saving_listeners`` as a list of CheckpointSaverListener (checked before any work)."""
    if listeners is None:
        return []
    if not isinstance(listeners, (list, tuple)):
        raise EstimatorTypeError(
            f"saving_listeners must be a list of CheckpointSaverListener, got {listeners!r}"
        )
    for listener in listeners:
        if not isinstance(listener, hooks_lib.CheckpointSaverListener):
            raise EstimatorTypeError(
                f"saving_listeners must be CheckpointSaverListener instances, given: {listener!r}"
            )
    return list(listeners)


def _check_loss_dtype(spec) -> None:
    """An integer loss has no gradient: training would silently never move."""
    dtype = getattr(spec.loss, "dtype", None)
    if dtype is not None and not jax.numpy.issubdtype(dtype, jax.numpy.floating):
        raise EstimatorTypeError(
            f"loss must be a floating-point scalar to be differentiated, "
            f"got dtype {dtype}; cast it in model_fn"
        )


def _loop_values(config: RunConfig, state: TrainState, losses, steps, host) -> dict:
    """What hooks can fetch after a loop: per-step loss, global step and named host_call
    tensors (and the count of skipped non-finite steps when they are skipped)."""
    values = {"loss": losses, "global_step": steps}
    if precision.skips_nonfinite(config):
        values[TrainSummaryHook.NONFINITE] = np.array([int(jax.device_get(state.nonfinite))])
    if state.loss_scale is not None:  # float16 compute: the scale after the loop
        scale = float(jax.device_get(state.loss_scale.scale))
        values[TrainSummaryHook.LOSS_SCALE] = np.array([scale])
    if isinstance(host, dict):
        values.update(host)
    return values


def _run_calls(
    loop, run: TrainRun, calls, guard: nonfinite.FiniteGuard
) -> tuple[np.ndarray, Any, int]:
    """Runs one loop's compiled calls back to back (``dispatch``); returns its per-step
    losses and host tensors, fetched to the host (global rows on every process), and its
    number of steps. Each call's all-finite flags are checked as it is fetched (``guard``;
    its input state, when kept for a replay, is released then). The input position
    advances with each call."""

    def launch(chunk: Chunk):
        kept = None
        if guard.keeps(chunk.steps):
            kept = nonfinite.Replay(run.state, chunk.features, chunk.labels)
        run.state, outputs = loop(run.state, chunk.features, chunk.labels)
        return outputs, kept

    def fetch(launched):
        return multihost.to_host(launched[0]), launched[1]

    parts, done = [], 0
    calls = goodput.each(calls, "input_wait")
    for chunk, (outputs, kept) in dispatch.dispatch(calls, launch=launch, fetch=fetch):
        losses, host, finite = outputs
        first = run.step + done + 1
        guard.check(finite, losses, np.arange(first, first + chunk.steps), kept)
        del kept
        parts.append((losses, host))
        done += chunk.steps
        run.position.input_pulls += chunk.pulls
        run.position.input_state = chunk.input_state
    losses, host = dispatch.concat_steps(parts)
    return losses, host, done
