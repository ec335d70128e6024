"""Evaluation, and the device loops prediction shares: every example counted exactly once."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.errors import EstimatorValueError
from ..core.runtime import seed_key_data
from ..core.spec import ModeKeys
from ..engine import tails
from ..engine.state import one_copy_on_cpu
from ..io.eval_events import write_eval_events
from ..io.restore import restore_variables
from ..parallel import multihost
from ..weights.scaffold import saver_sources
from . import dispatch, eval_loss
from .budget import StepBudget
from .hook_runner import HookRunner, Session
from .host import HostWorker, MetricAccumulator
from .job import Job

log = logging.getLogger("estimator")


class DeviceLoops:
    """The compiled calls of EVAL or PREDICT, with their hooks around each loop.

    Iterating yields ``(chunk, outputs, global_step)`` per loop part: each compiled call,
    cut where it carries a loop end (evaluation runs several loops per call,
    ``data/plan.py``). The hooks run around each loop of ``iterations_per_loop`` steps,
    one call behind the devices (docs/guide.md); a loop the input ends inside runs only its
    real steps. ``to_host`` copies a call's outputs to the host (default: every row, on
    every process). ``steps``: at most this many batches (None: the whole input).
    """

    def __init__(
        self, job: Job, input_fn, mode: str, *, steps, hooks, checkpoint_path, to_host=None
    ):
        self.job, self.input_fn, self.mode = job, input_fn, mode
        self.steps, self.hooks, self.checkpoint_path = steps, hooks, checkpoint_path
        self.to_host = to_host or multihost.to_host
        self._call = None  # (chunk features, labels, mask) -> device outputs, once restored

    def __iter__(self) -> Iterator:
        job, mode = self.job, self.mode
        pipe = job.feeder.pipeline(self.input_fn, mode, pad=True)
        ipl = job.config.tpu_config.iterations_per_loop
        budget = StepBudget(0, self.steps, iterations_per_loop=ipl)  # the one step count
        policy = job.feeder.layout(mode).loop_policy(unrolled=job.programs.unrolled(mode))

        def costs():  # of this mode's programs at the input's batch size (engine/tails.py)
            return job.programs.costs(mode, pipe.rows_per_step // job.num_replicas)

        prefetch = job.feeder.prefetch(
            pipe,
            budget.next_loop,
            policy,
            pad_short=lambda real, planned: costs().pad(real, planned, ipl),
        )
        try:
            chunk = next(prefetch, None)
            if chunk is None:
                what = "evaluate" if mode == ModeKeys.EVAL else "predict"
                raise EstimatorValueError(f"input_fn produced no batches to {what}")
            job.model.check_labels(pipe.has_labels)
            runner, global_step = self._start(chunk)
            # One dispatch over every call, across loop boundaries: the next loop's first call
            # is queued before the last one's outputs are fetched and its hooks run, so the
            # devices do not wait for the host between loops. A stop requested in after_run
            # drops the call already queued (evaluation keeps no position).
            calls = itertools.chain([chunk], prefetch)
            chunk = None  # the first call's input goes with its call
            fetched = tails.measured(
                costs(),
                lambda c: self._call(c.features, c.labels, c.mask),
                lambda launch: dispatch.dispatch(calls, launch=launch, fetch=self.to_host),
            )
            for part, outs in self._hooked(runner, _loop_parts(fetched)):
                yield part, outs, global_step
            runner.end()
        finally:
            prefetch.close()

    def _start(self, chunk) -> tuple[HookRunner, int]:
        """Restores the variables, compiles the loop for ``chunk``'s shapes and begins the
        hooks; returns them and the global step evaluated."""
        job, mode = self.job, self.mode
        batch = jax.tree.leaves(chunk.features)[0].shape[1] // job.num_replicas
        variables, global_step = restore_variables(
            job.programs,
            job.store,
            mode,
            (chunk.features, chunk.labels),
            batch,
            self.checkpoint_path,
            saver_sources=saver_sources,
            # Read by every call: one copy on CPU devices. Kept for the next evaluate or
            # predict of the same checkpoint, which then reads and places nothing.
            place=one_copy_on_cpu,
        )
        loop = job.programs.infer(mode, batch)
        spec = job.programs.spec(mode)
        if mode == ModeKeys.PREDICT:
            _check_predictions(spec.predictions, batch)
        spec_hooks = spec.evaluation_hooks if mode == ModeKeys.EVAL else spec.prediction_hooks
        runner = HookRunner(
            list(spec_hooks) + list(self.hooks or ()),
            Session(mode=mode, model_dir=job.model_dir, global_step=global_step),
            examples_per_step=job.feeder.layout(mode).global_rows or 0,
        )
        runner.begin()
        runner.after_create_session()
        # Placed on every device once, not copied there by each call.
        replicated = NamedSharding(job.mesh, P())
        rng = jax.device_put(seed_key_data(job.config.tf_random_seed), replicated)
        step_arr = jax.device_put(np.int32(global_step), replicated)
        self._call = functools.partial(loop, variables, step_arr, rng)
        return runner, global_step

    def _hooked(self, runner: HookRunner, parts: Iterator) -> Iterator:
        """The loop parts, with the hooks' before_run at each loop's first part and
        after_run at its last (or where the input ended); stops when a hook asks to."""
        done, steps, losses = 0, None, []
        for part, outs, ends_loop in parts:
            if steps is None:  # a loop begins: its planned steps
                steps, losses = np.arange(done + 1, done + part.loop_steps + 1), []
                runner.before_run(steps)
            done += part.steps
            yield part, outs
            if self.mode == ModeKeys.EVAL:
                losses.append(outs[0][: part.steps].mean(axis=1))
            if ends_loop:
                if runner.after_run(_loop_values(self.mode, losses), steps):
                    return
                steps = None
        if steps is not None:  # the input ended inside a loop: the steps it ran
            runner.after_run(_loop_values(self.mode, losses), steps[: done - steps[0] + 1])

    def padding_losses(self, chunk) -> np.ndarray:
        """The per-row losses of one all-padding step shaped like ``chunk``'s (evaluation)."""
        return self.to_host(self._call(*eval_loss.all_padding(chunk)))[0][0]


def _loop_parts(fetched: Iterator) -> Iterator:
    """``(part, outputs, ends a loop)`` per fetched call, a call cut at the loop ends it
    carries; the last part of a call keeps its padding steps."""
    for call, outs in fetched:
        cuts = [e for e in call.loop_ends if e < call.steps]
        if not cuts:
            yield call, outs, call.ends_loop
            continue
        rows, a = call.host_mask.shape[0], 0
        for b in [*cuts, call.steps]:
            end = b if b < call.steps else rows
            part = call._replace(host_mask=call.host_mask[a:end], steps=b - a, loop_ends=())
            yield part, jax.tree.map(lambda x, a=a, end=end: x[a:end], outs), b in call.loop_ends
            a = b


def _loop_values(mode: str, losses: list) -> dict:
    """What hooks may fetch after a loop: evaluation's per-step loss."""
    return {"loss": np.concatenate(losses)} if mode == ModeKeys.EVAL else {}


def _check_predictions(predictions: Any, rows: int) -> None:
    """Every prediction needs one row per example (a leading batch dimension of ``rows``)."""
    for path, value in jax.tree_util.tree_flatten_with_path(predictions)[0]:
        shape = tuple(getattr(value, "shape", ()))
        if not shape or shape[0] != rows:
            name = jax.tree_util.keystr(path) or "predictions"
            raise EstimatorValueError(
                f"prediction {name} has shape {shape}; predictions need a leading batch "
                f"dimension of {rows} (the rows model_fn was given) so they can be split "
                "into examples"
            )


def run_eval_loops(job: Job, input_fn, *, steps, hooks, checkpoint_path, name) -> dict:
    """Evaluates every example once; returns the metrics, ``loss`` and ``global_step``."""
    if steps is not None and (not isinstance(steps, int) or steps <= 0):
        raise EstimatorValueError(f"Must specify steps > 0, given: {steps}")
    mode = ModeKeys.EVAL
    layout = job.feeder.layout(mode)
    worker = HostWorker("eval-metrics")
    acc = MetricAccumulator()
    loss_sum, count, global_step = 0.0, 0, 0
    pad_losses = None
    loops = DeviceLoops(
        job, input_fn, mode, steps=steps, hooks=hooks, checkpoint_path=checkpoint_path
    )
    try:
        for chunk, (losses, tensors), global_step in loops:  # noqa: B007 (read after)
            mask = layout.count_once(chunk.host_mask)
            masked = bool(job.model.noted(mode, "padding_mask", False))
            if pad_losses is None and eval_loss.needs_pad_losses(
                mask, job.num_replicas, masked=masked
            ):  # a plain mean() over a partly padded batch: once, the padding rows' loss
                pad_losses = loops.padding_losses(chunk)
            loss_sum += eval_loss.real_loss_sum(
                losses, mask, job.num_replicas, None if masked else pad_losses
            )
            count += int(mask.sum())
            metric_fn = job.programs.spec(mode).eval_metrics
            if metric_fn is not None and multihost.is_process_0():  # once per eval batch
                worker.submit(lambda f=metric_fn[0], t=tensors, m=mask: acc.update_loop(f, t, m))

        def metrics() -> dict[str, Any]:
            worker.join()
            return acc.compute()

        # metric_fn runs on process 0 only; every process returns its results.
        results: dict[str, Any] = multihost.run_on_process_0(metrics, "eval_metrics' metric_fn")
    finally:
        worker.close()
    results["loss"] = loss_sum / count if count else 0.0
    results["global_step"] = global_step
    _write_results(job.eval_dir(name), results)
    return results


def _short(value: Any) -> str:
    """A metric for a log line: floats to 6 significant digits (the result keeps them all)."""
    return f"{value:.6g}" if isinstance(value, float | np.floating) else str(value)


def _write_results(eval_dir: str, results: dict) -> None:
    log.info(
        "Saving dict for global step %d: %s",
        results["global_step"],
        ", ".join(f"{k} = {_short(v)}" for k, v in sorted(results.items())),
    )
    scalars = {k: v for k, v in results.items() if k != "global_step" and np.ndim(v) == 0}
    # One event file per directory per process, on disk when evaluate returns (early-stopping
    # hooks read it); an unwritable directory is said once, and the results still returned.
    write_eval_events(eval_dir, scalars, results["global_step"])
