"""Input overlap: a slow input_fn against compute time.

Run from the repository root::

    python -m benchmarks.input_overlap [--quick] [--repeats N] [--no-memory]

The input_fn sleeps before every batch (a slow reader: the sleep releases the GIL as I/O
would). The sleep is calibrated to 0.5x, 1x and 2x the measured steady-state compute time of
one MLP training step. Each repeat times, interleaved:

* ``input only``: pulling the same batches from the slow input_fn, nothing else;
* ``compute only``: ``est.train`` with a fast input_fn (in-memory batches);
* ``estimator, slow input``: ``est.train`` with the slow input_fn.

Perfect overlap makes the slow-input run take ``max(input, compute)``; no overlap takes their
sum. The ceiling is ``max(input, compute)``, so ``ratio to ceiling = max / actual``. All
times are steady state (between the first and last loop end of a run, per step).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from collections.abc import Callable
from typing import NamedTuple

from benchmarks import _common as C
from benchmarks import _workloads as W
from benchmarks import train_throughput as T


class Setting(NamedTuple):
    model: str
    ipl: int
    steps: int
    sleep_factors: tuple[float, ...]


def setting(quick: bool) -> Setting:
    if quick:
        return Setting("mlp", 2, 4, (1.0,))
    return Setting("mlp", 10, 100, (0.5, 1.0, 2.0))


def input_only_case(s: Setting, data: W.Dataset, sleep: float) -> Callable[[], float]:
    """Seconds per batch of pulling ``steps`` batches from the slow input_fn."""
    input_fn = W.input_fn_for(data, cycle=True, sleep=sleep)

    def run() -> float:
        it = input_fn({"batch_size": data.global_batch})
        start = C.now()
        for _ in range(s.steps):
            next(it)
        return (C.now() - start) / s.steps

    return run


def train_case(est, s: Setting, data: W.Dataset, sleep: float) -> Callable[[], float]:
    """Steady-state seconds per step of ``est.train`` reading the (slow) input_fn."""
    input_fn = W.input_fn_for(data, cycle=True, sleep=sleep)

    def run() -> float:
        timer = C.LoopTimer()
        est.train(input_fn, steps=s.steps, hooks=[timer])
        return timer.per_step()

    return run


def compiled_estimator(s: Setting, data: W.Dataset, model_dir: str):
    """One estimator for every case: the loop compiles once, each train call continues."""
    est = W.make_estimator(
        s.model, model_dir, global_batch=data.global_batch, iterations_per_loop=s.ipl
    )
    C.warm_up(est, W.input_fn_for(data, cycle=True), s.ipl)
    return est


def measure(s: Setting, data: W.Dataset, tmp: str, repeats: int) -> tuple[float, list]:
    est = compiled_estimator(s, data, tmp)
    calibrate = train_case(est, s, data, 0.0)
    compute = statistics.median(calibrate() for _ in range(min(repeats, 3)))
    results = []
    for factor in s.sleep_factors:
        sleep = factor * compute
        cases = {
            "input only": input_only_case(s, data, sleep),
            "compute only": train_case(est, s, data, 0.0),
            "estimator, slow input": train_case(est, s, data, sleep),
        }
        results.append((factor, sleep, C.interleave(cases, repeats=repeats)))
    return compute, results


def probe(key: str, quick: bool) -> None:
    """Peak memory of training with the balanced slow input (sleep = ``key`` seconds)."""
    s = setting(quick)
    data = dataset_for(quick)
    mem = C.MemoryProbe()
    mem.start()
    tmp = tempfile.mkdtemp(prefix="bench_probe_")
    try:
        train_case(compiled_estimator(s, data, tmp), s, data, float(key))()
        C.print_probe_result(mem.result())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def dataset_for(quick: bool) -> W.Dataset:
    return W.make_dataset("mlp", batches=4 if quick else 100, global_batch=T.global_batch(quick))


def rows(s: Setting, results: list, mem: dict, batch: int) -> list[list]:
    out = []
    for factor, sleep, t in results:
        inp, comp, both = t["input only"], t["compute only"], t["estimator, slow input"]
        ideal = [max(i, c) for i, c in zip(inp, comp, strict=True)]
        serial = [i + c for i, c in zip(inp, comp, strict=True)]
        out.append(
            [
                s.model,
                s.ipl,
                f"{factor:g}x ({sleep * 1e3:.1f} ms)",
                statistics.median(inp) * 1e3,
                statistics.median(comp) * 1e3,
                statistics.median(both) * 1e3,
                statistics.median(ideal) * 1e3,
                statistics.median(serial) * 1e3,
                batch / statistics.median(both),
                C.median_ratio(ideal, both),
                mem.get(f"{sleep:.6f}"),
            ]
        )
    return out


COLUMNS = [
    "model",
    "IPL",
    "input sleep / compute",
    "input ms/step",
    "compute ms/step",
    "slow-input run ms/step",
    "max(input, compute)",
    "input + compute",
    "examples/s",
    "ratio to ceiling (max / actual)",
    "peak MiB",
]


def main(argv: list[str] | None = None) -> str:
    started = C.start(__doc__, argv, probe)
    if started is None:
        return ""
    args, repeats = started
    s, data = setting(args.quick), dataset_for(args.quick)
    tmp = tempfile.mkdtemp(prefix="bench_overlap_")
    try:
        compute, results = measure(s, data, tmp, repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    balanced = [f"{sleep:.6f}" for factor, sleep, _ in results if factor == 1.0]
    mem = C.probe_all(__spec__.name, balanced, quick=args.quick, skip=args.no_memory or args.quick)
    notes = [
        f"Global batch {data.global_batch}; compute calibrated at {compute * 1e3:.1f} ms/step "
        f"with fast input; {repeats} interleaved repeats, medians (of per-repeat ratios).",
        "Peak MiB: the balanced (1x) slow-input training in a fresh process.",
    ]
    return C.report("Input overlap", COLUMNS, rows(s, results, mem, data.global_batch), notes)


if __name__ == "__main__":
    main()
