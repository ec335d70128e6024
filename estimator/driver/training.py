"""The training loop: short and linear; logging, summaries and checkpoints attach around it.

One ``train`` call is a ``TrainRun`` in named phases: open the input (positioned where the
checkpoint left it), restore the state, assemble the hooks, loop, finish. One ``StepBudget``
(``budget.py``) says where it ends: the input schedule stages the loops it allows and the loop
stops when it is reached; ``TrainOutcome.reason`` says why it ended, in one log line.

One iteration (a loop of ``iterations_per_loop`` steps): hooks' before_run -> the loop's
compiled calls back to back (one, or several when its input exceeds
``max_staged_input_bytes``; ``dispatch``) -> its per-step outputs on the host -> host_call
and summaries on the host thread -> hooks' after_run (the NaN check among them) -> maybe
checkpoint. The next call's input is already on the devices. Each loop is given a
``Trained`` (the step, the state, the input position) and returns the next one, which is
what the checkpointer is given to save.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import jax
import numpy as np

import hooks as hooks_lib

from ..cluster import progress as cluster_progress
from ..core import summary
from ..core.config import RunConfig
from ..core.errors import EstimatorTypeError, EstimatorValueError
from ..core.spec import ModeKeys
from ..engine.loops import TrainState
from ..engine.options import StepOptions
from ..engine.state import fresh_train_state
from ..io import disk_full, lease
from ..io.lock import TrainerLock
from ..io.restore import restore_train_state
from ..io.store import LastState
from ..parallel import multihost
from ..weights.scaffold import IN_MODEL_FN, fresh_init_fn
from . import auto_loop, dispatch, goodput, goodput_record, hparams, nonfinite, progress, throughput
from .budget import StepBudget, log_end, planned_last_steps
from .checkpointer import Checkpointer, Position, Trained, save_then_drain, wait_committed
from .hook_runner import HookRunner, Session
from .host import HOST_CALL_QUEUE_LOOPS, HostWorker, run_host_calls
from .job import EndReason, Job, TrainOutcome
from .preemption import StopSignals
from .train_hooks import HyperparamSummaryHook, LossLoggingHook, NanLossHook, TrainSummaryHook
from .train_input import TrainInput

log = logging.getLogger("estimator")


class Attached(NamedTuple):
    """What the loop reports to and checkpoints through, made together once the state is
    restored (``TrainRun._attach``)."""

    runner: HookRunner
    saver: Checkpointer
    session: Session  # what hooks and listeners see; its ``save`` is ``TrainRun._save``
    writer: Any  # the model_dir's summary writer


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

    What the call asked for is set once. What changes is ``trained`` (the step reached, the
    ``TrainState`` and the input position): each loop is given it, the state donated, and
    returns the next one. The step ``budget`` is set where the call starts (``_start_at``);
    the hook runner, checkpointer, session and writer are ``attached`` together.
    """

    def __init__(
        self, job: Job, input_fn, *, hooks, steps, max_steps, warm_start_from, saving_listeners
    ):
        self.job = job
        self.user_hooks = list(hooks or ())
        self.steps, self.max_steps = steps, max_steps
        self.warm_start_from = warm_start_from
        self.listeners = _checked_listeners(saving_listeners)  # checked before any work
        self.input = TrainInput(job, input_fn)
        self.trained = Trained(0, None, Position())
        self.budget: StepBudget | None = None
        self.attached: Attached | None = None
        self.startup: progress.Startup | None = None
        self.goodput: goodput.Goodput | None = None

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
            goodput_record.write(self.goodput, self.trained.step)  # the next run counts losses

    def _run_locked(self) -> TrainOutcome:
        with goodput.phase("checkpoint"):
            meta = self._latest()
        self._start_at(meta)
        start = self.trained.step
        if self.budget.reached(start):
            outcome = TrainOutcome(start, EndReason.ALREADY_DONE)
            log_end(outcome, self.budget)
            return outcome
        with StopSignals() as signals:
            try:
                outcome = self._train(meta, signals)
            finally:
                self.input.close()
        if signals.requested:  # SIGTERM or Ctrl-C: the checkpoint of the step is committed
            outcome = outcome._replace(reason=EndReason.SIGNAL)
        log_end(outcome, self.budget, signal=signals.reason)
        if signals.requested:
            ckpts = self.job.store.writer()
            path = ckpts.path(outcome.step) if outcome.step in ckpts.steps() else None
            raise signals.stop_error(outcome.step, path).with_traceback(None) from None
        return outcome

    def _train(self, meta: dict, signals: StopSignals) -> TrainOutcome:
        if not (self.input.open(meta, self.budget.next_loop) and self.restore(meta)):
            reason = EndReason.SIGNAL if signals.requested else EndReason.INPUT_END
            return TrainOutcome(int(meta.get("global_step", 0)), reason)
        _check_loss_dtype(self.job.programs.spec(ModeKeys.TRAIN))
        goodput_record.resume(self.goodput, self.job.model_dir, meta)
        self.attached = attached = self._attach()
        worker = HostWorker(max_queued=HOST_CALL_QUEUE_LOOPS)  # the device waits for a slow host
        try:
            reason, losses = self.loop(worker, signals)
            self.finish(worker, signals, losses)
            with goodput.phase("checkpoint"):
                wait_committed(attached.saver.ckpts)
            goodput_record.report(self.goodput, attached.writer, self.trained.step)
        finally:
            self.input.close()
            worker.close(timeout=0.5 if signals.requested else 30)
            wait_committed(attached.saver.ckpts)
            # Closing (not flush) waits for tensorboardX's queue: summaries are on disk.
            summary.close(self.job.model_dir)
            summary.close_file_writers()  # those host_call opened with create_file_writer
        return TrainOutcome(self.trained.step, reason)

    def _latest(self) -> dict:
        """The meta of the newest checkpoint that looks intact ({}: none), verified when the
        call will skip."""
        ckpts = self.job.store.writer()
        latest = ckpts.latest_meta()
        if latest and self._budget(latest[0]).reached(latest[0]):
            latest = ckpts.latest_verified()  # about to skip: its arrays must read back
        return latest[1] if latest else {}

    def _start_at(self, meta: dict) -> None:
        """Starts the call where the checkpoint ``meta`` describes ({}: a fresh start): the
        step budget from its step, and the input position after it (the state follows in
        ``restore``)."""
        step = int(meta.get("global_step", 0))
        self.budget = self._budget(step)
        self.trained = Trained(step, None, Position.after(meta))

    def _budget(self, start: int) -> StepBudget:
        return StepBudget.of(
            start,
            steps=self.steps,
            max_steps=self.max_steps,
            hook_targets=planned_last_steps(self.user_hooks, start),
            iterations_per_loop=auto_loop.chosen(self.job),
        )

    # ------------------------------------------------------------------ phases
    def restore(self, meta: dict) -> bool:
        """The state: restored from the newest intact checkpoint (the call restarted where an
        older one had to be restored, since ``meta`` was not it), or fresh with the scaffold
        or warm start. False when the reopened input ended while skipping."""
        job, first, batch = self.job, self.input.first, self.input.model_batch
        example = (first.features, first.labels)
        with goodput.phase("checkpoint"):
            restored = restore_train_state(job.programs, job.store, example, batch)
        if restored is None:
            state = fresh_train_state(job.programs, example, batch, self._init_fn)
        else:
            state, restored_meta = restored
            if restored_meta.get("global_step") != meta.get("global_step"):
                # The newest checkpoint was damaged and an older one restored: reposition.
                self.input.close()
                first = example = None
                self._start_at(restored_meta)
                if not self.input.open(restored_meta, self.budget.next_loop):
                    return False
        self.trained = self.trained._replace(step=int(jax.device_get(state.step)), state=state)
        return True

    def _init_fn(self):
        """The fresh variables, once model_fn was traced (its scaffold_fn is known)."""
        return fresh_init_fn(
            self.job.programs.spec(ModeKeys.TRAIN),
            self.warm_start_from,
            in_model_fn=self.job.model.noted(ModeKeys.TRAIN, IN_MODEL_FN, ()),
        )

    def _attach(self) -> Attached:
        """The hook runner and the checkpointer, the session they hand hooks and listeners,
        and the summary writer: made together, once the state is restored."""
        job, step = self.job, self.trained.step
        layout = job.feeder.layout(ModeKeys.TRAIN)
        writer = summary.writer_for(job.model_dir)
        hooks = self._hooks(writer)
        session = Session(
            mode=ModeKeys.TRAIN, model_dir=job.model_dir, global_step=step, save=self._save
        )
        ckpts = job.store.writer()
        saver = Checkpointer(
            job.config,
            ckpts,
            job.store,
            session,
            self.listeners,
            last_step=step if ckpts.steps() else None,
            pulls_per_step=layout.pulls_per_step,
            rows_per_pull=layout.rows_per_pull,
            input_processes=layout.input_processes,
        )
        global_batch = layout.global_rows or self.input.model_batch
        runner = HookRunner(hooks, session, examples_per_step=global_batch)
        return Attached(runner, saver, session, writer)

    def _save(self, step: int | None = None) -> str | None:
        """``session.save`` (a user's ``CheckpointSaverHook``): the state the last loop
        handed on, as ``step`` when given."""
        trained = self.trained if step is None else self.trained._replace(step=step)
        return self.attached.saver.save(trained)

    def _hooks(self, writer) -> list:
        """Every hook of the call, in the order they run: the loop tuner, the start-up summary
        (its line comes before the first loss line), the default hooks, model_fn's
        ``training_hooks``, the user's, the progress bar, then the goodput record. A fresh
        start also writes its parameters to the HPARAMS tab."""
        job, cfg = self.job, self.job.config
        step, state = self.trained.step, self.trained.state
        layout = job.feeder.layout(ModeKeys.TRAIN)
        global_batch = layout.global_rows or self.input.model_batch
        compiled = self._train_program()
        call_steps = jax.tree.leaves(self.input.first.features)[0].shape[0]  # the first call's
        tuner = auto_loop.tuner_for(job, self.budget, call_steps=call_steps)
        first = progress.StartupSummaryHook(
            job.mesh,
            cfg,
            self.startup,
            options=job.options,
            global_batch=global_batch,
            replica_batch=self.input.model_batch,
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
        train_op = job.programs.spec(ModeKeys.TRAIN).train_op
        defaults = _default_hooks(
            cfg,
            given,
            options=job.options,
            writer=writer,
            examples_per_step=global_batch,
            opt_state=lambda: self.trained.state.opt_state,  # after each loop, before the next
            train_op=train_op,
            flops=throughput.ModelFlops.of(job, compiled, steps=call_steps),
        )
        if step == 0 and cfg.save_summary_steps:  # from scratch: params in the HPARAMS tab
            trainer = hparams.trainer_hparams(
                cfg, global_batch=global_batch, max_steps=self.budget.target, train_op=train_op
            )
            hparams.write_session_start(writer, {**trainer, **job.model.params})
        reporting = [goodput_record.GoodputHook(self.goodput)]
        return [*auto_loop.as_list(tuner), first, *defaults, *given, *reporting]

    def _train_program(self):
        """() -> the compiled train loop of the first chunk's shapes, the one the loop runs
        (for the DEBUG memory line and the model FLOPs; abstract shapes only, as the state
        is donated to the first loop)."""
        first = self.input.first
        if first is None:
            return None

        def abstract(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

        args = jax.tree.map(abstract, (self.trained.state, first.features, first.labels))
        programs, batch, steps = self.job.programs, self.input.model_batch, first.steps

        def compiled():  # what the calls ran: compiled ahead or loaded, else in jit's cache
            loop = programs.train_for(args[0], batch)
            return loop.executable(steps) or loop.lower(*args).compile()

        return compiled

    def loop(self, worker: HostWorker, signals: StopSignals) -> tuple[EndReason, np.ndarray | None]:
        """Runs loops until the budget is reached, a hook or listener stops, the input ends
        or a signal comes; returns which, and the last loop's per-step losses."""
        job, options = self.job, self.job.options
        runner, saver, session, _ = self.attached
        state = self.trained.state
        program = job.programs.train_for(state, self.input.model_batch)
        names = nonfinite.state_leaf_names(state.params, state.state, state.opt_state)
        guard = nonfinite.FiniteGuard(
            names, per_step=job.programs.per_step_flags(state), replay_loop=self._replay_loop()
        )
        runner.begin()
        for listener in saver.listeners:
            listener.begin()
        runner.after_create_session()
        first = self.input.take_first()
        if signals.requested and not multihost.is_multiprocess():
            first = None  # stopped during start-up: save the state as it is
        # A listener that evaluates (train_and_evaluate's) has its eval program compile meanwhile.
        evals = [x.evaluation_steps for x in self.listeners if hasattr(x, "evaluation_steps")]
        if first is not None and evals:
            layout = job.feeder.layout(ModeKeys.EVAL)
            job.programs.compile_eval_ahead(state, first, layout, steps=evals[0])
        loops = dispatch.loops_of(self.input.prefetch, first) if first is not None else iter(())
        loops = cluster_progress.each(loops, "input", then="hooks", step=lambda: self.trained.step)
        # Only the loop holds the first chunk (until its call is dispatched), and only
        # ``trained`` the state: one kept for a replay (not donated) is freed after its loop.
        del first, state
        job.store.forget()  # the state is donated to the loop from here on
        losses = None
        for loop_steps, calls in goodput.each(loops, "input_wait"):
            start = self.trained.step
            steps = np.arange(start + 1, start + loop_steps + 1)
            runner.before_run(steps)
            # each call's state is checked as it is fetched, before anything is saved
            with goodput.phase("productive"):
                self.trained, losses, host = _run_calls(program, self.trained, calls, guard)
            steps = steps[: self.trained.step - start]  # fewer when the input ended inside
            session.global_step = self.trained.step
            cluster_progress.enter("host_call", self.trained.step)
            self._host_call(worker, host, steps, signals)
            cluster_progress.enter("hooks")
            values = _loop_values(options, self.trained.state, losses, steps, host)
            hook_stop = runner.after_run(values, steps)
            multihost.check_worker(worker, "host_call")
            saver.maybe_save(self.trained)
            reason = self._stop_reason(hook_stop, signals)
            if reason is not None:
                return reason, losses
        # The input ended (or a stop request ended a wait for it).
        return (EndReason.SIGNAL if signals.requested else EndReason.INPUT_END), losses

    def _replay_loop(self):
        """() -> the per-step train program a failed call is replayed with (None when the
        programs keep no input state: non-finite steps are skipped)."""
        programs, batch = self.job.programs, self.input.model_batch
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
            lambda f=host_call[0], h=host, s=steps, w=self.attached.writer: run_host_calls(
                f, h, s, every_n, w
            ),
            what=(int(steps[0]), int(steps[-1])),
            interrupt=signals.event,
        )

    def _stop_reason(self, hook_stop: bool, signals: StopSignals) -> EndReason | None:
        """Why to stop after this loop, agreed by every process (they all stop together)."""
        hook, listener, signal = multihost.any_of(
            hook_stop, self.attached.saver.stop_requested, signals.requested
        )
        if signal:  # SIGTERM or Ctrl-C: checkpoint this step in finish, then stop
            return EndReason.SIGNAL
        if hook:
            return EndReason.HOOK
        if listener:
            return EndReason.LISTENER
        return EndReason.TARGET if self.budget.reached(self.trained.step) else None

    def finish(self, worker: HostWorker, signals: StopSignals, losses) -> None:
        """Hooks' end, the final checkpoint and the listeners' end; on a stop request the
        checkpoint first, with no evaluation or other listener work in the grace period.
        ``losses``: the last loop's, for the final log line."""
        runner, saver, session, _ = self.attached
        runner.end()
        trained = self.trained
        if signals.requested:
            saver.listeners = []
            save_then_drain(saver, worker, trained)
        else:
            cluster_progress.enter("host_call", trained.step)
            multihost.check_worker(worker, "host_call", join=True)
            saver.save(trained)
            for listener in saver.listeners:
                listener.end(session, trained.step)
        self.job.store.remember(LastState(trained.step, trained.state, saver.meta(trained)))
        if losses is not None:
            log.info("Loss for final step: %.4g.", float(losses[-1]))


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
    options: StepOptions,
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
            nonfinite=options.skip_nonfinite,
            loss_scale=options.policy.loss_scaled,
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
    if not (options.skip_nonfinite or own_nan):
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


def _loop_values(options: StepOptions, state: TrainState, losses, steps, host) -> dict:
    """What hooks can fetch after a loop: per-step loss, global step and named host_call
    tensors (and the count of skipped non-finite steps when they are skipped)."""
    values = {"loss": losses, "global_step": steps}
    if options.skip_nonfinite:
        values[TrainSummaryHook.NONFINITE] = np.array([int(jax.device_get(state.nonfinite))])
    if state.loss_scale is not None:  # float16 compute: the scale after the loop
        scale = float(jax.device_get(state.loss_scale.scale))
        values[TrainSummaryHook.LOSS_SCALE] = np.array([scale])
    if isinstance(host, dict):
        values.update(host)
    return values


def _run_calls(
    loop, trained: Trained, calls, guard: nonfinite.FiniteGuard
) -> tuple[Trained, np.ndarray, Any]:
    """Runs one loop's compiled calls back to back (``dispatch``) from ``trained``; returns
    what it hands on (the step reached, the state after it, the input position after its
    batches) and its per-step losses and host tensors, fetched to the host (global rows on
    every process). Each call's all-finite flags are checked as it is fetched (``guard``;
    its input state, when kept for a replay, is released then)."""
    step, state, position = trained

    def launch(chunk):
        nonlocal state
        kept = None
        if guard.keeps(chunk.steps):
            kept = nonfinite.Replay(state, chunk.features, chunk.labels)
        state, outputs = loop(state, chunk.features, chunk.labels)
        return outputs, kept

    def fetch(launched):
        return multihost.to_host(launched[0]), launched[1]

    parts = []
    calls = goodput.each(calls, "input_wait")
    # A call that keeps its input state is seen before the next is launched, so that state
    # is freed first: two copies alive, not three (docs/performance.md, finding 17).
    ahead = not guard.keeps_any()
    for chunk, (outputs, kept) in dispatch.dispatch(calls, launch=launch, fetch=fetch, ahead=ahead):
        losses, host, finite = outputs
        guard.check(finite, losses, np.arange(step + 1, step + chunk.steps + 1), kept)
        del kept
        parts.append((losses, host))
        step += chunk.steps
        position = Position(position.input_pulls + chunk.pulls, chunk.input_state)
    losses, host = dispatch.concat_steps(parts)
    return Trained(step, state, position), losses, host
