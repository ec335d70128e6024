"""What the built-in reporting costs: perf/ (model FLOPs, FLOP/s, MFU) and goodput/.

Run from the repository root::

    python -m benchmarks.reporting_overhead [--quick] [--repeats N]

The MLP (64-512-512-10, adam, global batch 256) trains at ``iterations_per_loop`` 100 with
TF's default cadences (summaries and step logs every 100 steps). Two estimators of the job
run in each repeat, one as it is and one with the reporting taken out in the same process
(the per-device figures of ``driver/throughput.py``; the goodput phases, record and report
of ``driver/goodput.py`` and ``driver/goodput_record.py``; the plain ``StepCounterHook`` in
their place), the roles swapped every repeat. Target: at most 1% slower, and no XLA
compilation in a timed call (the model FLOPs come from the program the loop already
compiled).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
from collections.abc import Iterator
from typing import NamedTuple
from unittest import mock

from benchmarks import _common as C
from benchmarks import _workloads as W
from benchmarks import train_throughput as T
from estimator.driver import goodput, goodput_record, throughput


class Setting(NamedTuple):
    model: str
    ipl: int
    steps: int


def settings(quick: bool) -> list[Setting]:
    return [Setting("mlp", 2, 4)] if quick else [Setting("mlp", 100, 400)]


@contextlib.contextmanager
def reporting_off() -> Iterator[None]:
    """The driver as it would be without this reporting (patched for this process)."""

    def inactive(gp):
        return contextlib.nullcontext(gp)

    noop = mock.Mock(return_value=None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(throughput.ModelFlops, "of", noop))
        stack.enter_context(mock.patch.object(goodput, "active", inactive))
        for name in ("resume", "write", "report"):
            stack.enter_context(mock.patch.object(goodput_record, name, noop))
        stack.enter_context(mock.patch.object(goodput_record.GoodputHook, "after_run", noop))
        yield


def warmed_estimators(s: Setting, data: W.Dataset, tmp: str) -> list:
    """Two estimators of the same job, compiled (the reporting changes no program)."""
    out = []
    for _ in range(2):
        est = W.make_estimator(
            s.model,
            tempfile.mkdtemp(dir=tmp),
            global_batch=data.global_batch,
            iterations_per_loop=s.ipl,
        )
        C.warm_up(est, W.input_fn_for(data, cycle=True), s.ipl)
        out.append(est)
    return out


def measure(s: Setting, data: W.Dataset, tmp: str, repeats: int) -> dict[str, list]:
    """``{"off": [Timing...], "on": [...]}``, each repeat timing both estimators, with the
    reporting on for one and off for the other, the roles swapped every repeat: two
    estimators of one job differ by a few percent on XLA:CPU (where their buffers landed,
    finding 11), which swapping cancels."""
    ests, input_fn = warmed_estimators(s, data, tmp), W.input_fn_for(data, cycle=True)
    out: dict[str, list] = {"off": [], "on": []}
    for r in range(repeats):
        for i, est in enumerate(ests):
            report = i == r % 2
            with contextlib.nullcontext() if report else reporting_off():
                out["on" if report else "off"].append(C.timed_train(est, input_fn, s.steps))
    return out


COLUMNS = [
    "model",
    "IPL",
    "reporting",
    "examples/s",
    "time / off",
    "whole call / off",
    "compiles/call",
]


def rows(s: Setting, times: dict[str, list], batch: int) -> list[list]:
    base = times["off"]
    return [
        [
            s.model,
            s.ipl,
            f"reporting {name}",
            batch / statistics.median(t.per_step for t in runs),
            C.median_ratio([t.per_step for t in runs], [t.per_step for t in base]),  # >1: slower
            C.median_ratio([t.wall for t in runs], [t.wall for t in base]),
            max(t.compiles for t in runs),
        ]
        for name, runs in times.items()
    ]


def main(argv: list[str] | None = None) -> str:
    started = C.start(__doc__, argv, lambda key, quick: None)
    if started is None:
        return ""
    args, repeats = started
    data = W.make_dataset(
        "mlp", batches=4 if args.quick else 100, global_batch=T.global_batch(args.quick)
    )
    (s,) = settings(args.quick)
    tmp = tempfile.mkdtemp(prefix="bench_reporting_")
    try:
        times = measure(s, data, tmp, repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    notes = [
        f"Global batch {data.global_batch}, {repeats} repeats of two estimators of the job, the "
        "reporting on for one and off for the other, swapped every repeat; medians of "
        "per-repeat ratios; examples/s and 'time / off' are steady state (between the first "
        "and last loop end of a run; above 1 is slower), 'whole call' the wall time of the "
        "train call.",
        "Target: time / off <= 1.01 and 0 compiles per timed call.",
        f"Host CPU cores: {os.cpu_count()}.",
    ]
    title = "Reporting overhead (perf/ and goodput/)"
    return C.report(title, COLUMNS, rows(s, times, data.global_batch), notes)


if __name__ == "__main__":
    main()
