"""The training loop: short and linear; logging, summaries and checkpoints attach around it.

One iteration: hooks' before_run -> one compiled call of ``n`` steps -> fetch the per-step
outputs once -> host_call and summaries on the host thread -> hooks' after_run (the NaN check
among them) -> maybe checkpoint. The next loop's input is already on the devices.
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

import hooks as hooks_lib

from .. import summary
from ..data.inputs import Prefetcher
from ..engine.state import fresh_train_state, restore_train_state, train_state_parts
from ..parallel import multihost
from ..scaffold import fresh_init_fn
from ..spec import ModeKeys
from . import progress
from .hook_runner import HookRunner, Session
from .host import HostWorker, run_host_calls
from .preemption import Preempted, PreemptionWatcher

log = logging.getLogger("estimator")


class _Saver:
    """Writes checkpoints at the configured cadence and at the end; never twice a step."""

    def __init__(self, est, ckpts, state_ref: list, position: dict):
        self.est, self.ckpts = est, ckpts
        self.state_ref, self.position = state_ref, position  # input_pulls, input_state
        cfg = est.config
        self.every_steps = cfg.save_checkpoints_steps
        self.every_secs = cfg.checkpoint_every_secs
        self.last_step = None
        self.last_time = time.monotonic()

    def save(self, step: int | None = None) -> str | None:
        state = self.state_ref[0]
        step = int(jax.device_get(state.step)) if step is None else step
        if step == self.last_step:
            return self.ckpts.path(step)
        variables, train = train_state_parts(state)
        self.ckpts.save(step, variables, train, self.meta(step))
        log.info("Saving checkpoints for %d into %s.", step, self.ckpts.path(step))
        self.last_step, self.last_time = step, time.monotonic()
        return self.ckpts.path(step)

    def meta(self, step: int) -> dict:
        """The JSON meta of a checkpoint: the step and the input position after it."""
        out = {"global_step": step, "input_pulls": self.position["input_pulls"]}
        if multihost.is_multiprocess():  # one iterator per process: keep every position
            states = multihost.gather_objects(self.position.get("input_state"))
            if any(s is not None for s in states):
                out["input_states"] = states
        elif self.position.get("input_state") is not None:
            out["input_state"] = self.position["input_state"]
        return out

    def maybe_save(self, step: int) -> None:
        due_steps = self.every_steps and step - (self.last_step or 0) >= self.every_steps
        due_secs = self.every_secs and time.monotonic() - self.last_time >= self.every_secs
        if due_secs:  # clocks differ between processes: save when any process is due
            (due_secs,) = multihost.any_of(due_secs)
        if due_steps or due_secs:
            self.save(step)


def _default_hooks(est, given=()) -> list:
    """NanTensorHook (unless non-finite steps are skipped, or the user passed their own
    NanTensorHook, e.g. ``fail_on_nan_loss=False``) and the step counter."""
    every = est.config.log_step_count_steps or 0
    own_nan = any(isinstance(h, hooks_lib.NanTensorHook) for h in given)
    out = [] if est.config.skip_nonfinite_steps or own_nan else [hooks_lib.NanTensorHook("loss")]
    if every:  # logs speed; the summaries come every save_summary_steps (TrainSummaries)
        out.append(hooks_lib.StepCounterHook(every_n_steps=every))
    return out


def _log_loss(every: int, losses: np.ndarray, steps: np.ndarray, clock: list) -> None:
    if not every or not any(s % every == 0 for s in steps):
        return
    now = time.monotonic()
    log.info(
        "loss = %s, step = %d (%.3f sec)", float(np.mean(losses)), int(steps[-1]), now - clock[0]
    )
    clock[0] = now


def _open_input(est, input_fn, meta: dict, target_fn):
    """The training input positioned after the batches ``meta`` says were consumed, and its
    first chunk; None when the input ended while skipping those batches.

    An iterator with ``get_state``/``set_state`` is restored to the saved state; otherwise a
    deterministic input_fn is fast-forwarded by the saved number of pulls.
    """
    resume = est.config.resume_input_position
    pipe = est._pipeline(input_fn, ModeKeys.TRAIN, pad=False)
    skip = int(meta.get("input_pulls", 0)) if resume else 0
    saved = meta.get("input_state")
    if meta.get("input_states") is not None:  # a many-process run: this process's position
        saved = meta["input_states"][jax.process_index()]
    if resume and pipe.stateful and saved is not None:
        pipe.set_state(saved)
        skip = 0
    begin = int(meta.get("global_step", 0))
    planned = [begin]
    ipl = est.config.tpu_config.iterations_per_loop

    def schedule() -> int:
        target = target_fn(begin)
        n = ipl if target is None else min(ipl, target - planned[0])
        planned[0] += max(n, 0)
        return n

    prefetch = est._prefetch(pipe, schedule, fill=False, skip=skip)
    try:
        first = next(prefetch)
    except StopIteration:
        prefetch.close()
        if skip:
            log.warning("Input ended: nothing left to train after %d consumed batches.", skip)
            return None
        raise ValueError("input_fn produced no training batches") from None
    except BaseException:
        prefetch.close()
        raise
    return pipe, prefetch, first


def _start(est, input_fn, batch_size, ckpts, latest, target_fn):
    """Builds the input stream and the state (restored, or fresh with scaffold/warm start)."""
    meta = latest[1] if latest else {}
    opened = _open_input(est, input_fn, meta, target_fn)
    if opened is None:
        return None
    pipe, prefetch, first = opened
    model_batch = jax.tree.leaves(first.features)[0].shape[1] // est.num_replicas
    try:
        est._model.check_labels(pipe.has_labels)
        restored = restore_train_state(est, ckpts, first, model_batch)
    except BaseException:
        prefetch.close()
        raise
    if restored is None:
        state = fresh_train_state(est, first, model_batch, lambda: fresh_init_fn(est))
        return state, {"input_pulls": 0}, first, prefetch, model_batch
    state, restored_meta = restored
    if restored_meta.get("global_step") != meta.get("global_step"):
        # The newest checkpoint was damaged and an older one restored: reposition the input.
        prefetch.close()
        opened = _open_input(est, input_fn, restored_meta, target_fn)
        if opened is None:
            return None
        pipe, prefetch, first = opened
    position = {
        "input_pulls": int(restored_meta.get("input_pulls", 0)),
        "input_state": restored_meta.get("input_state"),
    }
    return state, position, first, prefetch, model_batch


def _stop_hook_targets(user_hooks, start_step: int) -> list[int]:
    """Last steps of the user's StopAtStepHooks, so the final loop lands on them exactly."""
    out = []
    for hook in user_hooks or ():
        if isinstance(hook, hooks_lib.StopAtStepHook):
            num = getattr(hook, "_num_steps", None)
            out.append(hook.last_step if hook.last_step is not None else start_step + num)
    return out


def run_train_loops(est, input_fn, *, hooks, steps, max_steps) -> None:
    ckpts = est._writer_checkpoints()
    latest = ckpts.latest_meta()  # the newest step that looks intact
    start_step = latest[0] if latest else 0
    if max_steps is not None and start_step >= max_steps:
        log.info(
            "Skipping training since max_steps has already saved (step %d; max_steps %d).",
            start_step,
            max_steps,
        )
        return
    batch_size = est._global_batch(ModeKeys.TRAIN)

    def target_fn(begin: int) -> int | None:
        """The step to stop at, for a run that starts (is restored) at ``begin``."""
        targets = [
            t for t in (max_steps, None if steps is None else begin + steps) if t is not None
        ] + _stop_hook_targets(hooks, begin)
        return min(targets) if targets else None

    with PreemptionWatcher() as watcher:
        started = _start(est, input_fn, batch_size, ckpts, latest, target_fn)
        if started is None:
            return
        _run(est, ckpts, started, hooks, target_fn, watcher)


def _check_loss_dtype(est) -> None:
    """An integer loss has no gradient: training would silently never move."""
    dtype = getattr(est._holder[ModeKeys.TRAIN].loss, "dtype", None)
    if dtype is not None and not jax.numpy.issubdtype(dtype, jax.numpy.floating):
        raise TypeError(
            f"loss must be a floating-point scalar to be differentiated, "
            f"got dtype {dtype}; cast it in model_fn"
        )


def _run(est, ckpts, started, hooks, target_fn, watcher) -> None:
    state, pulls, first, prefetch, model_batch = started
    try:
        _check_loss_dtype(est)
    except TypeError:
        prefetch.close()
        raise
    step = int(jax.device_get(state.step))
    global_batch = est._batch[ModeKeys.TRAIN] or model_batch
    progress.log_startup_summary(
        est,
        global_batch=global_batch,
        replica_batch=model_batch,
        params=state.params,
        start_step=step,
        target=target_fn(step),
    )
    extra = []
    if progress.progress_enabled(est.config.progress_bar):
        extra.append(progress.ProgressBarHook(start=step, total=target_fn(step)))
    _train(
        est, ckpts, state, pulls, first, prefetch, model_batch, list(hooks or ()) + extra, watcher
    )


def _train(
    est, ckpts, state, position, first, prefetch: Prefetcher, model_batch, user_hooks, watcher
):
    cfg = est.config
    writer = summary.writer_for(est.model_dir)
    spec = est._holder[ModeKeys.TRAIN]
    state_ref = [state]
    saver = _Saver(est, ckpts, state_ref, position)
    step = int(jax.device_get(state.step))
    saver.last_step = step if ckpts.steps() else None
    global_batch = est._batch[ModeKeys.TRAIN] or model_batch
    session = Session(
        mode=ModeKeys.TRAIN, model_dir=est.model_dir, global_step=step, save=saver.save
    )
    given = list(spec.training_hooks) + list(user_hooks or ())
    all_hooks = _default_hooks(est, given) + given
    runner = HookRunner(all_hooks, session, examples_per_step=global_batch)
    loop = est._loop(ModeKeys.TRAIN, model_batch)
    worker = HostWorker()
    every_n = cfg.tpu_config.host_call_every_n_steps
    clock = [time.monotonic()]
    summaries = summary.TrainSummaries(
        writer, every=cfg.save_summary_steps, examples_per_step=global_batch
    )
    runner.begin()
    runner.after_create_session()
    chunk, preempted = first, False
    est._live = None  # the state is donated to the loop from here on
    est._stopped_by_hook = False
    try:
        while chunk is not None:
            steps = np.arange(step + 1, step + chunk.steps + 1)
            runner.before_run(steps)
            state, (losses, host) = loop(state_ref[0], chunk.features, chunk.labels)
            state_ref[0] = state
            losses, host = multihost.to_host((losses, host))  # global rows on every process
            step += chunk.steps
            position["input_pulls"] += chunk.pulls
            position["input_state"] = chunk.input_state
            session.global_step = step
            host_call = est._holder[ModeKeys.TRAIN].host_call
            if host_call is not None and multihost.is_process_0():  # once, on process 0
                worker.submit(
                    lambda f=host_call[0], h=host, s=steps: run_host_calls(f, h, s, every_n, writer)
                )
            nonfinite = int(jax.device_get(state.nonfinite)) if cfg.skip_nonfinite_steps else None
            summaries.after_loop(losses, steps, nonfinite)
            _log_loss(cfg.log_step_count_steps, losses, steps, clock)
            values = {"loss": losses, "global_step": steps}
            if isinstance(host, dict):
                values.update(host)
            stop = runner.after_run(values, steps)
            multihost.check_worker(worker, "host_call")
            saver.maybe_save(step)
            stop, preempted = multihost.any_of(stop, watcher.requested)  # all stop together
            if stop:
                est._stopped_by_hook = True
                break
            if preempted:  # SIGTERM: checkpoint this step below, then exit
                break
            chunk = next(prefetch, None)
        runner.end()
        multihost.check_worker(worker, "host_call", join=True)
        saver.save(step)
        est._live = (step, state_ref[0], saver.meta(step))
        log.info("Loss for final step: %s.", float(losses[-1]))
    finally:
        prefetch.close()
        worker.close()
        ckpts.wait()
        # Closing (not flush) waits for tensorboardX's queue: summaries are on disk on return.
        summary.close(est.model_dir)
    if preempted:  # the checkpoint of ``step`` is on disk: exit as TF's handler did
        raise Preempted(step, ckpts.path(step))
