"""``iterations_per_loop="auto"`` against the fixed values 1, 10, 100 and 1000.

Run from the repository root::

    python -m benchmarks.auto_loop [--quick] [--repeats N]

The MLP (64-512-512-10, adam, global batch 256) trains with summaries and step logs every
1000 steps, so every IPL up to 1000 keeps their cadence and "auto" may choose up to 1000.
Each estimator is warmed up first ("auto" long enough to choose, then to compile the
chosen loop), and the timed calls are interleaved. Target: "auto" within 5% of the best
fixed value (``time / best fixed`` at most 1.05).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from collections.abc import Callable

import estimator
from benchmarks import _common as C
from benchmarks import _workloads as W
from benchmarks import train_throughput as T
from estimator.driver import auto_loop

CADENCE = 1000


def fixed(quick: bool) -> tuple[int, ...]:
    return (1, 2) if quick else (1, 10, 100, 1000)


def make_estimator(model_dir: str, global_batch: int, ipl, cadence: int):
    config = estimator.RunConfig(
        model_dir=model_dir,
        tpu_config=estimator.TPUConfig(iterations_per_loop=ipl),
        save_summary_steps=cadence,
        log_step_count_steps=cadence,
        compilation_cache_dir=False,
        progress_bar=False,
        resume_input_position=False,
    )
    return estimator.TPUEstimator(
        W.model_fn, config=config, params={"model": "mlp"}, train_batch_size=global_batch
    )


def case(ipl, data: W.Dataset, model_dir: str, *, steps: int, cadence: int) -> Callable:
    est = make_estimator(model_dir, data.global_batch, ipl, cadence)
    input_fn = W.input_fn_for(data, cycle=True)
    bound = est.config.tpu_config.iterations_per_loop
    C.warm_up(est, input_fn, bound)
    if ipl == "auto":  # the choice (three loops), then the chosen loop's program
        est.train(input_fn, steps=4 * bound)
        C.warm_up(est, input_fn, auto_loop.chosen(est._job))

    def run() -> tuple[C.Timing, int]:
        return C.timed_train(est, input_fn, steps), auto_loop.chosen(est._job)

    return run


def main(argv: list[str] | None = None) -> str:
    started = C.start(__doc__, argv, lambda key, quick: None, default_repeats=3)
    if started is None:
        return ""
    args, repeats = started
    data = T.dataset_for("mlp", args.quick)
    cadence, steps = (2, 4) if args.quick else (CADENCE, 2000)
    tmp = tempfile.mkdtemp(prefix="bench_auto_loop_")
    try:
        cases = {
            str(n): case(n, data, tempfile.mkdtemp(dir=tmp), steps=steps, cadence=cadence)
            for n in (*fixed(args.quick), "auto")
        }
        results = C.interleave(cases, repeats=repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    best = min(
        (str(n) for n in fixed(args.quick)),
        key=lambda n: statistics.median(t.per_step for t, _ in results[n]),
    )
    rows = []
    for name, runs in results.items():
        per_step = [t.per_step for t, _ in runs]
        best_per_step = [t.per_step for t, _ in results[best]]
        rows.append(
            [
                "mlp",
                name if name != "auto" else f"auto (chose {runs[-1][1]})",
                data.global_batch / statistics.median(per_step),
                C.median_ratio(per_step, best_per_step),
                max(t.compiles for t, _ in runs),
            ]
        )
    notes = [
        f"Global batch {data.global_batch}, {steps} steps per timed call, summaries and step "
        f"logs every {cadence} steps, {repeats} interleaved repeats, medians; "
        f"'time / best fixed' per step against IPL {best} (above 1 is slower).",
        f"Host CPU cores: {os.cpu_count()}.",
    ]
    columns = ["model", "iterations_per_loop", "examples/s", "time / best fixed", "compiles/call"]
    return C.report('iterations_per_loop="auto"', columns, rows, notes)


if __name__ == "__main__":
    main()
