"""host_call overhead: training with a host_call writing two scalars every step vs none.

Run from the repository root::

    python -m benchmarks.host_call_overhead [--quick] [--repeats N] [--no-memory]

The MLP trains at ``iterations_per_loop`` 100 (and 10) with ``host_call=(host_fn, [loss[None],
accuracy[None]])``, where ``host_fn`` calls ``estimator.summary.scalar`` twice, run for every
step (``host_call_every_n_steps=1``), against the same estimator without a host_call and the
hand-written ceiling (``jit(shard_map(scan))``, pre-staged data, no host work). The number of
``host/loss`` summaries on disk after each run is read back and checked.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from typing import NamedTuple

from benchmarks import _common as C
from benchmarks import _workloads as W
from benchmarks import train_throughput as T
from hooks import event_reader


class Setting(NamedTuple):
    model: str
    ipl: int
    steps: int


def settings(quick: bool) -> list[Setting]:
    if quick:
        return [Setting("mlp", 2, 4)]
    return [Setting("mlp", 100, 300), Setting("mlp", 10, 300)]


def summaries_written(model_dir: str, tag: str = "host/loss") -> int:
    """How many ``tag`` scalars the event files in ``model_dir`` hold (read back from disk)."""
    return sum(tag in values for values in event_reader.read_eval_metrics(model_dir).values())


def estimator_case(
    s: Setting, data: W.Dataset, model_dir: str, *, host_call: bool
) -> Callable[[], C.Timing]:
    est = W.make_estimator(
        s.model,
        model_dir,
        global_batch=data.global_batch,
        iterations_per_loop=s.ipl,
        host_call=host_call,
    )
    input_fn = W.input_fn_for(data, cycle=True)
    C.warm_up(est, input_fn, s.ipl)

    def run() -> C.Timing:
        before = summaries_written(model_dir) if host_call else 0
        timing = C.timed_train(est, input_fn, s.steps)
        if host_call:
            written = summaries_written(model_dir) - before
            if written != s.steps:
                raise AssertionError(
                    f"host_call wrote {written} host/loss summaries for {s.steps} steps"
                )
        return timing

    return run


def cases(s: Setting, data: W.Dataset, tmp: str, only: str | None = None) -> dict:
    ceiling = T.Setting(s.model, False, (s.ipl,), s.steps)
    makers = {
        "ceiling": lambda: T.ceiling_case(ceiling, s.ipl, data),
        "estimator, no host_call": lambda: estimator_case(
            s, data, tempfile.mkdtemp(dir=tmp), host_call=False
        ),
        "estimator, host_call every step": lambda: estimator_case(
            s, data, tempfile.mkdtemp(dir=tmp), host_call=True
        ),
    }
    return {k: make() for k, make in makers.items() if only is None or k == only}


def dataset_for(quick: bool) -> W.Dataset:
    return W.make_dataset("mlp", batches=4 if quick else 100, global_batch=T.global_batch(quick))


def probe(key: str, quick: bool) -> None:
    index, name = key.split(":", 1)
    s = settings(quick)[int(index)]
    data = dataset_for(quick)
    mem = C.MemoryProbe()
    mem.start()
    tmp = tempfile.mkdtemp(prefix="bench_probe_")
    try:
        cases(s, data, tmp, only=name)[name]()
        C.print_probe_result(mem.result())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def rows(results, mem: dict, batch: int) -> list[list]:
    out = []
    for i, (s, times) in enumerate(results):
        base = times["estimator, no host_call"]
        ceiling = times["ceiling"]
        for name, runs in times.items():
            per_step = [t.per_step for t in runs]
            m, m_base = mem.get(f"{i}:{name}"), mem.get(f"{i}:ceiling")
            estimator = name != "ceiling"
            out.append(
                [
                    s.model,
                    s.ipl,
                    name,
                    batch / statistics.median(per_step),
                    C.median_ratio([t.per_step for t in ceiling], per_step),
                    C.median_ratio([t.per_step for t in base], per_step) if estimator else None,
                    C.median_ratio([t.wall for t in base], [t.wall for t in runs])
                    if estimator
                    else None,
                    m,
                    None if m is None or not m_base else m / m_base,
                ]
            )
    return out


COLUMNS = [
    "model",
    "IPL",
    "loop",
    "examples/s",
    "ratio to ceiling",
    "ratio to no host_call",
    "whole call vs no host_call",
    "peak MiB",
    "memory / ceiling",
]


def main(argv: list[str] | None = None) -> str:
    started = C.start(__doc__, argv, probe)
    if started is None:
        return ""
    args, repeats = started
    data = dataset_for(args.quick)
    results = C.interleave_settings(
        settings(args.quick), cases, data, repeats=repeats, prefix="bench_host_call_"
    )
    keys = [f"0:{name}" for name in results[0][1]]
    mem = C.probe_all(__spec__.name, keys, quick=args.quick, skip=args.no_memory or args.quick)
    notes = [
        f"Global batch {data.global_batch}, adam, {repeats} interleaved repeats, medians of "
        "per-repeat ratios; examples/s and ratios are steady state (between the first and "
        "last loop end of a run), 'whole call' is the wall time of the whole train call.",
        "Every run's host/loss summaries were read back from disk: one per step.",
        "Peak MiB: growth of peak host RSS over the baseline, each case in a fresh process "
        f"(IPL {results[0][0].ipl} only).",
        f"Host CPU cores: {os.cpu_count()}; the host_call thread shares them with the eight "
        "simulated devices.",
    ]
    return C.report("host_call overhead", COLUMNS, rows(results, mem, data.global_batch), notes)


if __name__ == "__main__":
    main()
