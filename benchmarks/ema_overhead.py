"""Moving-average weights: training with ``ExponentialMovingAverage.apply(adam)`` vs plain adam.

Run from the repository root::

    python -m benchmarks.ema_overhead [--quick] [--repeats N] [--no-memory]

The MLP (64-512-512-10) trains at ``iterations_per_loop`` 100 with ``optax.adam`` and with
``estimator.ExponentialMovingAverage(0.999, num_updates=True).apply(optax.adam)``, whose
shadow is updated on the device after every step (one more multiply-add over the parameters
per step, and one more copy of them in the optimizer state). Target: at most 5% slower.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

import estimator
from benchmarks import _common as C
from benchmarks import _workloads as W
from benchmarks import train_throughput as T

DECAY = 0.999


class Setting(NamedTuple):
    model: str
    ipl: int
    steps: int


def settings(quick: bool) -> list[Setting]:
    if quick:
        return [Setting("mlp", 2, 4)]
    return [Setting("mlp", 100, 300)]


def model_fn(features, labels, mode, params):
    """The benchmarks' model_fn, its train_op wrapped by the moving average when asked."""
    spec = W.model_fn(features, labels, mode, params)
    if mode != estimator.ModeKeys.TRAIN or not params.get("ema"):
        return spec
    ema = estimator.ExponentialMovingAverage(DECAY, num_updates=True)
    return estimator.TPUEstimatorSpec(mode, loss=spec.loss, train_op=ema.apply(spec.train_op))


def make_estimator(s: Setting, model_dir: str, global_batch: int, *, ema: bool):
    """As ``_workloads.make_estimator`` (TF's defaults), with this module's model_fn."""
    config = estimator.RunConfig(
        model_dir=model_dir,
        tpu_config=estimator.TPUConfig(iterations_per_loop=s.ipl),
        compilation_cache_dir=False,
        progress_bar=False,
        resume_input_position=False,
    )
    return estimator.TPUEstimator(
        model_fn,
        config=config,
        params={"model": s.model, "ema": ema},
        train_batch_size=global_batch,
    )


def estimator_case(s: Setting, data: W.Dataset, model_dir: str, *, ema: bool) -> Callable:
    est = make_estimator(s, model_dir, data.global_batch, ema=ema)
    input_fn = W.input_fn_for(data, cycle=True)
    C.warm_up(est, input_fn, s.ipl)
    if ema:  # the shadow is really there, and trails the raw weights
        name = next(n for n, _ in estimator.list_variables(model_dir) if n.endswith("kernel"))
        shadow = estimator.load_variable(model_dir, f"{name}/ExponentialMovingAverage")
        if shadow.shape != est.get_variable_value(name).shape or not np.isfinite(shadow).all():
            raise AssertionError(f"no usable moving average of {name} in {model_dir}")

    def run() -> C.Timing:
        return C.timed_train(est, input_fn, s.steps)

    return run


CASES = ("estimator, adam", "estimator, adam + ExponentialMovingAverage")


def cases(s: Setting, data: W.Dataset, tmp: str, only: str | None = None) -> dict:
    makers = {
        CASES[0]: lambda: estimator_case(s, data, tempfile.mkdtemp(dir=tmp), ema=False),
        CASES[1]: lambda: estimator_case(s, data, tempfile.mkdtemp(dir=tmp), ema=True),
    }
    return {k: make() for k, make in makers.items() if only is None or k == only}


def dataset_for(quick: bool) -> W.Dataset:
    return W.make_dataset("mlp", batches=4 if quick else 100, global_batch=T.global_batch(quick))


def probe(key: str, quick: bool) -> None:
    index, name = key.split(":", 1)
    s = settings(quick)[int(index)]
    mem = C.MemoryProbe()
    mem.start()
    tmp = tempfile.mkdtemp(prefix="bench_probe_")
    try:
        cases(s, dataset_for(quick), tmp, only=name)[name]()
        C.print_probe_result(mem.result())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


COLUMNS = [
    "model",
    "IPL",
    "train_op",
    "examples/s",
    "time / adam",
    "whole call / adam",
    "peak MiB",
]


def rows(results, mem: dict, batch: int) -> list[list]:
    out = []
    for i, (s, times) in enumerate(results):
        base = times[CASES[0]]
        for name, runs in times.items():
            per_step = [t.per_step for t in runs]
            out.append(
                [
                    s.model,
                    s.ipl,
                    name,
                    batch / statistics.median(per_step),
                    C.median_ratio(per_step, [t.per_step for t in base]),  # time: >1 slower
                    C.median_ratio([t.wall for t in runs], [t.wall for t in base]),
                    mem.get(f"{i}:{name}"),
                ]
            )
    return out


def main(argv: list[str] | None = None) -> str:
    started = C.start(__doc__, argv, probe)
    if started is None:
        return ""
    args, repeats = started
    data = dataset_for(args.quick)
    results = C.interleave_settings(
        settings(args.quick), cases, data, repeats=repeats, prefix="bench_ema_"
    )
    keys = [f"0:{name}" for name in results[0][1]]
    mem = C.probe_all(__spec__.name, keys, quick=args.quick, skip=args.no_memory or args.quick)
    notes = [
        f"Global batch {data.global_batch}, {repeats} interleaved repeats, medians of per-repeat "
        "ratios; examples/s and 'time / adam' are steady state (between the first and last "
        "loop end of a run; above 1 is slower), 'whole call' is the wall time of the train call "
        "(the checkpoint it writes holds the shadow too).",
        f"ExponentialMovingAverage({DECAY}, num_updates=True); target: time / adam <= 1.05.",
        "Peak MiB: growth of peak host RSS over the baseline, each case in a fresh process.",
        f"Host CPU cores: {os.cpu_count()}.",
    ]
    return C.report(
        "ExponentialMovingAverage overhead",
        COLUMNS,
        rows(results, mem, batch=data.global_batch),
        notes,
    )


if __name__ == "__main__":
    main()
