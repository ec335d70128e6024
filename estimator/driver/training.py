"""The training loop: short and linear; logging, summaries and checkpoints attach around it.

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
from ..config import RunConfig
from ..data.inputs import Chunk, Prefetcher
from ..engine import precision
from ..engine.loops import TrainState
from ..engine.state import fresh_train_state, train_state_parts
from ..errors import EstimatorTypeError, EstimatorValueError
from ..io.checkpoint import Checkpoints
from ..io.input_position import ROWS_KEY, resume_pulls
from ..io.lock import TrainerLock
from ..io.restore import restore_train_state
from ..io.store import LastState, StateStore
from ..parallel import multihost
from ..scaffold import IN_MODEL_FN, fresh_init_fn
from ..spec import ModeKeys
from . import dispatch, hparams, nonfinite, preemption, progress
from .hook_runner import HookRunner, Session
from .host import HOST_CALL_QUEUE_LOOPS, HostWorker, run_host_calls
from .job import Job, TrainOutcome
from .preemption import StopSignals
from .train_hooks import HyperparamSummaryHook, LossLoggingHook, NanLossHook, TrainSummaryHook

log = logging.getLogger("estimator")


@dataclasses.dataclass
class _Position:
    """Where the training input stands: batches consumed, and the iterator's own state."""

    input_pulls: int = 0
    input_state: Any = None


@dataclasses.dataclass
class _Run:
    """The mutable state of one ``train`` call, owned by the loop."""

    state: TrainState
    position: _Position


class _Saver:
    """Writes checkpoints at the configured cadence and at the end; never twice a step.

    ``listeners`` (``CheckpointSaverListener``s, e.g. train_and_evaluate's evaluation) are
    called around each save; while their ``after_save`` runs, the store's last state is the
    one just saved, so an evaluation reads it without reloading. One returning True asks
    training to stop (``stop_requested``).
    """

    def __init__(
        self,
        config: RunConfig,
        ckpts: Checkpoints,
        run: _Run,
        store: StateStore,
        listeners=(),
        *,
        pulls_per_step: int = 1,
        rows_per_pull: int | None = None,
    ):
        self.ckpts, self.run, self.store = ckpts, run, store
        self.listeners, self.session = list(listeners), None
        self.stop_requested = False
        self.pulls_per_step, self.rows_per_pull = pulls_per_step, rows_per_pull
        self.every_steps = config.save_checkpoints_steps
        self.every_secs = config.checkpoint_every_secs
        self.last_step = None
        self.last_time = time.monotonic()

    def save(self, step: int | None = None) -> str | None:
        state = self.run.state
        step = int(jax.device_get(state.step)) if step is None else step
        if step == self.last_step:
            return self.ckpts.path(step)
        for listener in self.listeners:
            listener.before_save(self.session, step)
        variables, train = train_state_parts(state)
        meta = self.meta(step)
        self.ckpts.save(step, variables, train, meta)
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

    def meta(self, step: int) -> dict:
        """The JSON meta of a checkpoint: the step and the input position after it."""
        position = self.run.position
        out = {"global_step": step, "input_pulls": position.input_pulls}
        # Pulls beyond the steps' own: short batches skipped (bounds a resume's fast-forward).
        out["skipped_pulls"] = max(position.input_pulls - step * self.pulls_per_step, 0)
        if self.rows_per_pull:  # a resume with another batch size counts in examples
            out[ROWS_KEY] = self.rows_per_pull
        if multihost.is_multiprocess():  # one iterator per process: keep every position
            states = multihost.gather_objects(position.input_state)
            if any(s is not None for s in states):
                out["input_states"] = states
        elif position.input_state is not None:
            out["input_state"] = position.input_state
        return out

    def maybe_save(self, step: int) -> None:
        due_steps = self.every_steps and step - (self.last_step or 0) >= self.every_steps
        due_secs = self.every_secs and time.monotonic() - self.last_time >= self.every_secs
        if due_secs:  # clocks differ between processes: save when any process is due
            (due_secs,) = multihost.any_of(due_secs)
        if due_steps or due_secs:
            self.save(step)


def _default_hooks(
    config: RunConfig, given, *, writer, examples_per_step: int, opt_state=lambda: None
) -> list:
    """The training summaries (loss, speed, injected hyperparameters of the train_op, read
    through ``opt_state()``) and the loss log line, NanTensorHook (unless non-finite steps
    are skipped, or the user passed their own NanTensorHook, e.g. ``fail_on_nan_loss=False``)
    and the step counter."""
    every = config.log_step_count_steps or 0
    out = [
        TrainSummaryHook(
            writer,
            every=config.save_summary_steps,
            examples_per_step=examples_per_step,
            nonfinite=precision.skips_nonfinite(config),
            loss_scale=precision.uses_loss_scale(config.tpu_config.compute_dtype),
        ),
        HyperparamSummaryHook(writer, every=config.save_summary_steps, opt_state=opt_state),
    ]
    if every:
        out.append(LossLoggingHook(every))
    own_nan = any(isinstance(h, hooks_lib.NanTensorHook) for h in given)
    if not (precision.skips_nonfinite(config) or own_nan):
        out.append(NanLossHook("loss"))
    if every:  # logs speed; the summaries come every save_summary_steps (TrainSummaries)
        out.append(hooks_lib.StepCounterHook(every_n_steps=every))
    return out


def _open_input(job: Job, input_fn, meta: dict, target_fn):
    """The training input positioned after the batches ``meta`` says were consumed, and its
    first chunk; None when the input ended while skipping those batches.

    An iterator with ``get_state``/``set_state`` is restored to the saved state; otherwise a
    deterministic input_fn is fast-forwarded by the saved number of pulls.
    """
    resume = job.config.resume_input_position
    pipe = job.feeder.pipeline(input_fn, ModeKeys.TRAIN, pad=False)
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
        )
    if resume and pipe.stateful and saved is not None:
        pipe.set_state(saved)
        skip = 0
    begin = int(meta.get("global_step", 0))
    planned = [begin]
    ipl = job.config.tpu_config.iterations_per_loop

    def schedule() -> int:
        target = target_fn(begin)
        n = ipl if target is None else min(ipl, target - planned[0])
        planned[0] += max(n, 0)
        return n

    pipe.global_step = begin
    signals = preemption.active()  # a stop request ends a wait for input
    interrupt = None if signals is None else signals.event
    prefetch = job.feeder.prefetch(pipe, schedule, fill=False, skip=skip, interrupt=interrupt)
    try:
        first = next(prefetch)
    except StopIteration:
        prefetch.close()
        if interrupt is not None and interrupt.is_set():
            return None
        if skip:
            log.warning("Input ended: nothing left to train after %d consumed batches.", skip)
            return None
        raise EstimatorValueError("input_fn produced no training batches") from None
    except BaseException:
        prefetch.close()
        raise
    return pipe, prefetch, first


@dataclasses.dataclass
class _Started:
    """A train call ready to loop: its state and input position, the first chunk (handed
    to the loop once, so its input is not held until ``train`` returns)."""

    run: _Run
    first: Chunk | None
    prefetch: Prefetcher
    model_batch: int  # rows model_fn sees per replica


def _start(job: Job, input_fn, latest, target_fn, warm_start_from) -> _Started | None:
    """Builds the input stream and the state (restored, or fresh with scaffold/warm start)."""
    meta = latest[1] if latest else {}
    opened = _open_input(job, input_fn, meta, target_fn)
    if opened is None:
        return None
    pipe, prefetch, first = opened
    model_batch = jax.tree.leaves(first.features)[0].shape[1] // job.num_replicas
    try:
        job.model.check_labels(pipe.has_labels)
        restored = restore_train_state(
            job.programs, job.store, (first.features, first.labels), model_batch
        )
    except BaseException:
        prefetch.close()
        raise
    if restored is None:

        def init_fn():  # after model_fn was traced: its scaffold_fn is known
            return fresh_init_fn(
                job.programs.spec(ModeKeys.TRAIN),
                warm_start_from,
                in_model_fn=job.model.noted(ModeKeys.TRAIN, IN_MODEL_FN, ()),
            )

        state = fresh_train_state(
            job.programs, (first.features, first.labels), model_batch, init_fn
        )
        return _Started(_Run(state, _Position()), first, prefetch, model_batch)
    state, restored_meta = restored
    if restored_meta.get("global_step") != meta.get("global_step"):
        # The newest checkpoint was damaged and an older one restored: reposition the input.
        prefetch.close()
        opened = _open_input(job, input_fn, restored_meta, target_fn)
        if opened is None:
            return None
        pipe, prefetch, first = opened
    position = _Position(int(restored_meta.get("input_pulls", 0)), restored_meta.get("input_state"))
    return _Started(_Run(state, position), first, prefetch, model_batch)


def _planned_last_steps(user_hooks, start_step: int) -> list[int]:
    """Steps the user's hooks plan to stop at (``planned_last_step``), so the final loop
    lands on them exactly."""
    out = []
    for hook in user_hooks or ():
        planned = getattr(hook, "planned_last_step", None)
        step = planned(start_step) if callable(planned) else None
        if step is not None:
            out.append(int(step))
    return out


def run_train_loops(
    job: Job, input_fn, *, hooks, steps, max_steps, warm_start_from=None, saving_listeners=()
) -> TrainOutcome:
    """Trains until ``steps`` more, ``max_steps`` in all, a hook's stop or the input's end;
    ``saving_listeners`` (``CheckpointSaverListener``) are called around every checkpoint.

    Raises:
      ModelDirInUseError: another trainer holds the model_dir (see ``io/lock.py``).
    """
    called = time.monotonic()
    saving_listeners = _checked_listeners(saving_listeners)
    lock = TrainerLock(job.model_dir)  # one trainer per model_dir; process 0 holds it
    multihost.run_on_process_0(lock.acquire, f"locking model_dir {job.model_dir}")
    startup = progress.Startup(since=called)
    try:
        return _train_locked(
            job,
            input_fn,
            hooks=hooks,
            steps=steps,
            max_steps=max_steps,
            warm_start_from=warm_start_from,
            saving_listeners=saving_listeners,
            startup=startup,
        )
    finally:
        startup.close()
        lock.release()


def _train_locked(
    job: Job, input_fn, *, hooks, steps, max_steps, warm_start_from, saving_listeners, startup
):
    ckpts = job.store.writer()
    latest = ckpts.latest_meta()  # the newest step that looks intact
    if max_steps is not None and latest and latest[0] >= max_steps:
        latest = ckpts.latest_verified()  # about to skip: its arrays must read back
    start_step = latest[0] if latest else 0
    if max_steps is not None and start_step >= max_steps:
        log.info(
            "Skipping training since max_steps has already saved (step %d; max_steps %d).",
            start_step,
            max_steps,
        )
        return TrainOutcome(start_step, trained=False)

    def target_fn(begin: int) -> int | None:
        """The step to stop at, for a run that starts (is restored) at ``begin``."""
        targets = [
            t for t in (max_steps, None if steps is None else begin + steps) if t is not None
        ] + _planned_last_steps(hooks, begin)
        return min(targets) if targets else None

    with StopSignals() as signals:
        started = _start(job, input_fn, latest, target_fn, warm_start_from)
        if started is None and not signals.requested:
            return TrainOutcome(start_step, trained=False)
        outcome = (
            TrainOutcome(start_step, trained=False)
            if started is None
            else _run(job, started, hooks, target_fn, startup, saving_listeners)
        )
    if signals.requested:  # SIGTERM or Ctrl-C: the checkpoint of the step is committed
        ckpts = job.store.writer()
        path = ckpts.path(outcome.step) if outcome.step in ckpts.steps() else None
        raise signals.stop_error(outcome.step, path).with_traceback(None) from None
    if outcome.input_ended:
        _log_input_end(outcome.step, steps=steps, max_steps=max_steps, target=target_fn(start_step))
    return outcome


def _log_input_end(step: int, *, steps, max_steps, target) -> None:
    """Training ended because the input did: say where, and what was not reached."""
    if target is None:
        log.info("Input ended at global step %d.", step)
    elif step < target and max_steps is not None and target == max_steps:
        log.warning("Input ended at global step %d: max_steps = %d was not reached.", step, target)
    elif step < target and steps is not None:
        log.warning(
            "Input ended at global step %d: steps = %d (to global step %d) was not reached.",
            step,
            steps,
            target,
        )
    elif step < target:
        log.warning("Input ended at global step %d, before the planned stop at %d.", step, target)


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


def _train_program(job: Job, started: _Started):
    """() -> the compiled train loop of the first chunk's shapes (for the DEBUG memory line;
    abstract shapes only, as the state is donated to the first loop)."""
    if started.first is None or not log.isEnabledFor(logging.DEBUG):
        return None

    def abstract(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    args = jax.tree.map(abstract, (started.run.state, started.first.features, started.first.labels))
    return lambda: job.programs.train(started.model_batch).lower(*args).compile()


def _run(job: Job, started: _Started, hooks, target_fn, startup, saving_listeners) -> TrainOutcome:
    try:
        _check_loss_dtype(job.programs.spec(ModeKeys.TRAIN))
    except TypeError:
        started.prefetch.close()
        raise
    step = int(jax.device_get(started.run.state.step))
    global_batch = job.feeder.layout(ModeKeys.TRAIN).global_rows or started.model_batch
    summary_hook = progress.StartupSummaryHook(
        job.mesh,
        job.config,
        startup,
        global_batch=global_batch,
        replica_batch=started.model_batch,
        params=started.run.state.params,
        opt_state=started.run.state.opt_state,
        state=started.run.state.state,
        start_step=step,
        target=target_fn(step),
        train_program=_train_program(job, started),
    )
    extra = []
    if progress.progress_enabled(job.config.progress_bar):
        extra.append(progress.ProgressBarHook(start=step, total=target_fn(step)))
    # The start-up line comes first, before the first loop's loss line.
    return _train(
        job, started, list(hooks or ()) + extra, saving_listeners, first_hooks=[summary_hook]
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


def _train(
    job: Job, started: _Started, user_hooks, saving_listeners, *, first_hooks=()
) -> TrainOutcome:
    cfg, run, prefetch = job.config, started.run, started.prefetch
    ckpts = job.store.writer()
    writer = summary.writer_for(job.model_dir)
    spec = job.programs.spec(ModeKeys.TRAIN)
    saver = _Saver(
        cfg,
        ckpts,
        run,
        job.store,
        saving_listeners,
        pulls_per_step=job.feeder.layout(ModeKeys.TRAIN).pulls_per_step,
        rows_per_pull=job.feeder.layout(ModeKeys.TRAIN).rows_per_pull,
    )
    step = int(jax.device_get(run.state.step))
    saver.last_step = step if ckpts.steps() else None
    global_batch = job.feeder.layout(ModeKeys.TRAIN).global_rows or started.model_batch
    session = Session(
        mode=ModeKeys.TRAIN, model_dir=job.model_dir, global_step=step, save=saver.save
    )
    saver.session = session
    given = list(spec.training_hooks) + list(user_hooks or ())
    defaults = _default_hooks(
        cfg,
        given,
        writer=writer,
        examples_per_step=global_batch,
        opt_state=lambda: run.state.opt_state,  # after each loop, before the next one
    )
    if step == 0 and cfg.save_summary_steps:  # from scratch: params in the HPARAMS tab
        hparams.write_session_start(writer, job.model.params)
    all_hooks = list(first_hooks) + defaults + given
    runner = HookRunner(all_hooks, session, examples_per_step=global_batch)
    loop = job.programs.train(started.model_batch)
    worker = HostWorker(max_queued=HOST_CALL_QUEUE_LOOPS)  # the device waits for a slow host
    signals = preemption.active()
    names = nonfinite.state_leaf_names(run.state.params, run.state.state, run.state.opt_state)
    every_n = cfg.tpu_config.host_call_every_n_steps
    runner.begin()
    for listener in saver.listeners:
        listener.begin()
    runner.after_create_session()
    first, losses, stopped, input_ended = started.first, None, False, False
    started.first = None
    if signals.requested and not multihost.is_multiprocess():
        first = None  # stopped during start-up: save the state as it is
    # A listener that evaluates (train_and_evaluate's) has its eval program compile meanwhile.
    evals = [x.evaluation_steps for x in saver.listeners if hasattr(x, "evaluation_steps")]
    if first is not None and evals:
        layout = job.feeder.layout(ModeKeys.EVAL)
        job.programs.compile_eval_ahead(run.state, first, layout, steps=evals[0])
    loops = dispatch.loops_of(prefetch, first) if first is not None else iter(())
    del first  # the loop holds it until its call is dispatched
    job.store.forget()  # the state is donated to the loop from here on
    try:
        for loop_steps, calls in loops:
            steps = np.arange(step + 1, step + loop_steps + 1)
            runner.before_run(steps)
            losses, host, finite, done = _run_calls(loop, run, calls)
            steps = steps[:done]  # fewer when the input ended inside the loop
            nonfinite.check_finite(finite, losses, steps, names)  # before anything is saved
            step += done
            session.global_step = step
            host_call = spec.host_call
            if host_call is not None and multihost.is_process_0():  # once, on process 0
                worker.submit(
                    lambda f=host_call[0], h=host, s=steps: run_host_calls(
                        f, h, s, every_n, writer
                    ),
                    what=(int(steps[0]), int(steps[-1])),
                    interrupt=signals.event,
                )
            stop = runner.after_run(_loop_values(cfg, run.state, losses, steps, host), steps)
            multihost.check_worker(worker, "host_call")
            saver.maybe_save(step)
            stop, stopping = multihost.any_of(  # all stop together
                stop or saver.stop_requested, signals.requested
            )
            if stop:
                stopped = True
                break
            if stopping:  # SIGTERM or Ctrl-C: checkpoint this step below, then stop
                break
        else:  # the input ended (or a stop request ended a wait for it)
            input_ended = not signals.requested
        runner.end()
        if signals.requested:  # no evaluation or other listener work in the grace period
            saver.listeners = []
            _save_then_drain(saver, ckpts, worker, step)
        else:
            multihost.check_worker(worker, "host_call", join=True)
            saver.save(step)
            for listener in saver.listeners:
                listener.end(session, step)
        job.store.remember(LastState(step, run.state, saver.meta(step)))
        if losses is not None:
            log.info("Loss for final step: %.4g.", float(losses[-1]))
    finally:
        prefetch.close()
        worker.close(timeout=0.5 if signals.requested else 30)
        _wait_committed(ckpts)
        # Closing (not flush) waits for tensorboardX's queue: summaries are on disk on return.
        summary.close(job.model_dir)
        summary.close_file_writers()  # those host_call opened with create_file_writer
    return TrainOutcome(step, stopped_by_hook=stopped, input_ended=input_ended)


def _save_then_drain(saver: _Saver, ckpts: Checkpoints, worker: HostWorker, step: int) -> None:
    """On a stop request: the checkpoint first (committed), then host work still queued gets
    ``HOST_DRAIN_SECS``; what is left is skipped with a warning."""
    saver.save(step)
    ckpts.wait()
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


def _wait_committed(ckpts: Checkpoints) -> None:
    """Waits for a checkpoint write in flight, even when a second Ctrl-C lands in the wait
    (an Orbax thread left running at exit prints tracebacks)."""
    try:
        ckpts.wait()
    except KeyboardInterrupt:
        ckpts.wait()
        raise


def _run_calls(loop, run: _Run, calls) -> tuple[np.ndarray, Any, np.ndarray, int]:
    """Runs one loop's compiled calls back to back (``dispatch``); returns its per-step
    losses, host tensors and all-finite flags, fetched to the host (global rows on every
    process), and its number of steps. The input position advances with each call."""

    def launch(chunk: Chunk):
        run.state, outputs = loop(run.state, chunk.features, chunk.labels)
        return outputs

    parts, done = [], 0
    for chunk, outputs in dispatch.dispatch(calls, launch=launch, fetch=multihost.to_host):
        parts.append(outputs)
        done += chunk.steps
        run.position.input_pulls += chunk.pulls
        run.position.input_state = chunk.input_state
    losses, host, finite = dispatch.concat_steps(parts)
    return losses, host, finite, done
