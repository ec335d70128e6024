"""Evaluation, and the device loops prediction shares: every example counted exactly once."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..engine import tails
from ..engine.state import one_copy_on_cpu
from ..errors import EstimatorValueError
from ..io.eval_events import write_eval_events
from ..io.restore import restore_variables
from ..parallel import multihost
from ..runtime import seed_key_data
from ..scaffold import saver_sources
from ..spec import ModeKeys
from . import dispatch, eval_loss
from .hook_runner import HookRunner, Session
from .host import HostWorker, MetricAccumulator
from .job import Job

log = logging.getLogger("estimator")


def device_loops(
    job: Job,
    input_fn,
    mode: str,
    *,
    steps: int | None,
    hooks,
    checkpoint_path,
    to_host=multihost.to_host,
    pad_probe: list | None = None,
) -> Iterator:
    """Yields ``(chunk, outputs, global_step)`` per compiled call of EVAL or PREDICT, split
    where a call runs several loops (evaluation, ``data/plan.py``); the hooks run around
    each loop of ``iterations_per_loop`` steps, one call behind the devices (docs/guide.md).
    A loop the input ends inside runs only its real steps. ``to_host`` copies a call's
    outputs to the host (default: every row, on every process).
    ``pad_probe`` (a list) receives ``probe(chunk) -> outputs`` of the same loop on an
    all-padding chunk shaped like ``chunk``.
    """
    pipe = job.feeder.pipeline(input_fn, mode, pad=True)
    ipl = job.config.tpu_config.iterations_per_loop
    left = [steps]

    def schedule() -> int:
        if left[0] is None:
            return ipl
        n = min(ipl, left[0])
        left[0] -= n
        return n

    # Evaluation may run several loops per call, unless unrolled programs would grow with it.
    merge = mode == ModeKeys.EVAL and not job.programs.unrolled(mode)

    def costs():  # of this mode's programs at the input's batch size (engine/tails.py)
        return job.programs.costs(mode, pipe.rows_per_step // job.num_replicas)

    prefetch = job.feeder.prefetch(
        pipe,
        schedule,
        fill=True,
        merge_loops=merge,
        pad_short=lambda real, planned: costs().pad(real, planned, ipl),
    )
    try:
        chunk = next(prefetch, None)
        if chunk is None:
            raise EstimatorValueError(
                f"input_fn produced no batches to {'evaluate' if mode == 'eval' else 'predict'}"
            )
        job.model.check_labels(pipe.has_labels)
        batch = jax.tree.leaves(chunk.features)[0].shape[1] // job.num_replicas
        variables, global_step = restore_variables(
            job.programs,
            job.store,
            mode,
            (chunk.features, chunk.labels),
            batch,
            checkpoint_path,
            saver_sources=saver_sources,
        )
        variables = one_copy_on_cpu(variables)  # read by every call: one copy on CPU devices
        loop = job.programs.infer(mode, batch)
        spec = job.programs.spec(mode)
        if mode == ModeKeys.PREDICT:
            _check_predictions(spec.predictions, batch)
        spec_hooks = spec.evaluation_hooks if mode == ModeKeys.EVAL else spec.prediction_hooks
        runner = HookRunner(
            list(spec_hooks) + list(hooks or ()),
            Session(mode=mode, model_dir=job.model_dir, global_step=global_step),
            examples_per_step=job.feeder.layout(mode).global_rows or 0,
        )
        runner.begin()
        runner.after_create_session()
        # Placed on every device once, not copied there by each call.
        replicated = NamedSharding(job.mesh, P())
        rng = jax.device_put(seed_key_data(job.config.tf_random_seed), replicated)
        step_arr = jax.device_put(np.int32(global_step), replicated)
        if pad_probe is not None:
            pad_probe.append(
                lambda c: to_host(loop(variables, step_arr, rng, *eval_loss.all_padding(c)))
            )

        def launch(c):
            return loop(variables, step_arr, rng, c.features, c.labels, c.mask)

        # One dispatch over every call, across loop boundaries: the next loop's first call is
        # queued before the last one's outputs are fetched and its hooks run, so the devices
        # do not wait for the host between loops. Hooks still see each loop in order; a stop
        # requested in after_run drops the call already queued (evaluation keeps no position).
        calls = itertools.chain([chunk], prefetch)
        chunk = None  # the first call's input goes with its call
        fetched = tails.measured(
            costs(), launch, lambda launch: dispatch.dispatch(calls, launch=launch, fetch=to_host)
        )
        done, start, losses, counters = 0, 0, [], None
        for part, outs in _by_loop(fetched, ipl):
            if counters is None:  # the first part of a loop
                start, losses = done, []
                planned = ipl if steps is None else min(ipl, steps - done)
                counters = np.arange(done + 1, done + planned + 1)
                runner.before_run(counters)
            done += part.steps
            yield part, outs, global_step
            if mode == ModeKeys.EVAL:
                losses.append(outs[0][: part.steps].mean(axis=1))
            if done - start == len(counters):  # the loop is complete
                if runner.after_run(_loop_values(mode, losses), counters):
                    break
                counters = None
        else:
            if counters is not None:  # the input ended inside a loop
                runner.after_run(_loop_values(mode, losses), counters[: done - start])
        runner.end()
    finally:
        prefetch.close()


def _by_loop(fetched: Iterator, ipl: int) -> Iterator:
    """``(chunk, outputs)`` per fetched call, a call that runs several loops split where a
    loop ends (every loop but the last has ``ipl`` steps, so loops end at its multiples)."""
    done = 0
    for call, outs in fetched:
        if done // ipl == (done + call.steps - 1) // ipl:  # within one loop: as it is
            done += call.steps
            yield call, outs
            continue
        rows = call.host_mask.shape[0]  # steps the call ran, padding ones included
        a = 0
        while a < call.steps:
            b = min(call.steps, a + ipl - (done + a) % ipl)
            end = b if b < call.steps else rows  # the last part keeps the padding steps
            part = call._replace(host_mask=call.host_mask[a:end], steps=b - a)
            yield part, jax.tree.map(lambda x, a=a, end=end: x[a:end], outs)
            a = b
        done += call.steps


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
    mode = ModeKeys.EVAL
    layout = job.feeder.layout(mode)
    worker = HostWorker("eval-metrics")
    acc = MetricAccumulator()
    loss_sum, count, global_step = 0.0, 0, 0
    probe, pad_losses = [], None
    try:
        for chunk, (losses, tensors), global_step in device_loops(  # noqa: B007 (read after)
            job,
            input_fn,
            mode,
            steps=steps,
            hooks=hooks,
            checkpoint_path=checkpoint_path,
            pad_probe=probe,
        ):
            mask = layout.count_once(chunk.host_mask)
            masked = bool(job.model.noted(mode, "padding_mask", False))
            if pad_losses is None and eval_loss.needs_pad_losses(
                mask, job.num_replicas, masked=masked
            ):  # a plain mean() over a partly padded batch: once, the padding rows' loss
                pad_losses = probe[0](chunk)[0][0]
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
