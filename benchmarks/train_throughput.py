"""Training throughput: TPUEstimator.train against hand-written JAX on the same eight devices.

Run from the repository root::

    python -m benchmarks.train_throughput [--quick] [--repeats N] [--no-memory]

For the MLP (64-512-512-10) and a small CNN, at ``iterations_per_loop`` (IPL) 1, 10, 100:

* ``ceiling``: ``jit(shard_map(scan(step)))`` with donated state and the whole dataset
  pre-staged on the devices as ``[IPL, GB, ...]`` chunks, blocking after every loop: the best
  loop a JAX expert would write.
* ``per-step jit``: the typical ``jit(train_step)`` Python loop, one ``device_put`` of a
  numpy batch per step, blocking every 10 steps (more queued multi-device
  programs can deadlock XLA:CPU).
* ``estimator``: ``est.train(input_fn, steps=N)`` on an estimator that has already compiled
  (its ``input_fn`` yields the same numpy batches).

Two ratios are reported. ``ratio to ceiling`` compares steady-state speed, timed between the
ends of the first and the last device loop of each run (a hook stamps the estimator's loops).
``whole call`` compares the wall time of the whole N-step run, which for the estimator also
holds ``train``'s start (input start-up, first dispatch) and end (the checkpoint it must
write before returning); ``fixed s/call`` is that difference in seconds.

Convolutions inside a rolled ``lax.scan`` are very slow on XLA:CPU (jax-ml/jax#12868), and an
unrolled 100-step CNN loop took ~6 minutes to compile here, so the CNN runs unrolled at IPL 1
and 10 (``TPUConfig(unroll_loops=True)``, ``unroll=True`` for the ceiling) and one rolled
IPL-10 row shows the cost of not unrolling.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from collections.abc import Callable
from typing import NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _common as C
from benchmarks import _workloads as W

SYNC_EVERY = 10  # per-step loop: block every 10 dispatched steps (in-flight limit on CPU)


class Setting(NamedTuple):
    """One model's group of interleaved cases; ``steps`` per timed run."""

    model: str
    unroll: bool
    ipls: tuple[int, ...]
    steps: int
    per_step: bool = True  # include the per-step jit loop
    max_repeats: int | None = None  # fewer repeats for a slow group


def settings(quick: bool) -> list[Setting]:
    if quick:
        return [Setting("mlp", False, (2,), 4)]
    return [
        Setting("mlp", False, (1, 10, 100), 300),
        Setting("cnn", True, (1, 10), 20),
        Setting("cnn", False, (10,), 20, per_step=False, max_repeats=3),
    ]


def global_batch(quick: bool) -> int:
    return 32 if quick else 256


def dataset_for(model: str, quick: bool) -> W.Dataset:
    return W.make_dataset(model, batches=4 if quick else 100, global_batch=global_batch(quick))


# ----------------------------------------------------------------------------- the three loops
def ceiling_case(
    s: Setting, ipl: int, data: W.Dataset, *, num_microbatches: int = 1
) -> Callable[[], C.Timing]:
    mesh = W.make_mesh()
    loop = W.ceiling_loop(s.model, mesh, unroll=s.unroll, num_microbatches=num_microbatches)
    chunks = W.stage_chunks(data, ipl, mesh)
    state = [W.init_state(s.model, mesh, data.x[0])]

    def run() -> C.Timing:
        stamps = [C.now()]
        for i in range(s.steps // ipl):
            state[0], losses = loop(state[0], *chunks[i % len(chunks)])
            jax.block_until_ready(losses)  # block every loop, as the estimator does
            stamps.append(C.now())
        return C.Timing(stamps[-1] - stamps[0], C.steady_per_step(stamps[1:], s.steps - ipl))

    state[0], _ = jax.block_until_ready(loop(state[0], *chunks[0]))  # compile
    return run


def per_step_case(s: Setting, data: W.Dataset) -> Callable[[], C.Timing]:
    mesh = W.make_mesh()
    step = W.per_step_fn(s.model, mesh)
    sharding = NamedSharding(mesh, P(W.DATA))
    state = [W.init_state(s.model, mesh, data.x[0])]
    sync = min(SYNC_EVERY, s.steps // 2)

    def run() -> C.Timing:
        stamps = [C.now()]
        for i in range(s.steps):
            b = i % data.batches
            x, y = jax.device_put((data.x[b], data.y[b]), sharding)
            state[0], loss = step(state[0], x, y)
            if (i + 1) % sync == 0:
                jax.block_until_ready(loss)
                stamps.append(C.now())
        jax.block_until_ready(state[0])
        wall = C.now() - stamps[0]
        return C.Timing(wall, C.steady_per_step(stamps[1:], sync * (len(stamps) - 2)))

    x, y = jax.device_put((data.x[0], data.y[0]), sharding)
    state[0], _ = jax.block_until_ready(step(state[0], x, y))  # compile
    return run


def estimator_case(s: Setting, ipl: int, data: W.Dataset, model_dir: str) -> Callable[[], C.Timing]:
    est = W.make_estimator(
        s.model, model_dir, global_batch=data.global_batch, iterations_per_loop=ipl, unroll=s.unroll
    )
    input_fn = W.input_fn_for(data, cycle=True)
    C.warm_up(est, input_fn, ipl)  # compiles init and the loop, leaves the state live
    return lambda: C.timed_train(est, input_fn, s.steps)


def cases(s: Setting, data: W.Dataset, tmp: str, only: str | None = None) -> dict:
    """``{name: run}`` of a setting, in the order they interleave (built lazily by name)."""
    makers: dict[str, Callable[[], Callable[[], C.Timing]]] = {}
    if s.per_step:
        makers["per-step jit"] = lambda: per_step_case(s, data)
    for ipl in s.ipls:
        makers[f"ceiling@{ipl}"] = lambda ipl=ipl: ceiling_case(s, ipl, data)
        makers[f"estimator@{ipl}"] = lambda ipl=ipl: estimator_case(
            s, ipl, data, tempfile.mkdtemp(dir=tmp)
        )
    return {k: make() for k, make in makers.items() if only is None or k == only}


# ----------------------------------------------------------------------------- memory
def probe_keys(quick: bool) -> list[str]:
    """The cases whose peak memory is measured: each setting's largest IPL and per-step."""
    keys = []
    for i, s in enumerate(settings(quick)):
        if not s.unroll and s.model == "cnn":
            continue  # the rolled CNN row is about speed
        names = (["per-step jit"] if s.per_step else []) + [
            f"ceiling@{s.ipls[-1]}",
            f"estimator@{s.ipls[-1]}",
        ]
        keys += [f"{i}:{n}" for n in names]
    return keys


def probe(key: str, quick: bool) -> None:
    """Peak memory of one case (its warm-up and one timed run) in this fresh process."""
    index, name = key.split(":", 1)
    s = settings(quick)[int(index)]
    data = dataset_for(s.model, quick)
    mem = C.MemoryProbe()
    mem.start()
    tmp = tempfile.mkdtemp(prefix="bench_probe_")
    try:
        cases(s, data, tmp, only=name)[name]()
        C.print_probe_result(mem.result())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- main
def measure(quick: bool, repeats: int) -> list[tuple[Setting, dict[str, list[C.Timing]]]]:
    out = []
    tmp = tempfile.mkdtemp(prefix="bench_train_")
    try:
        for s in settings(quick):
            out.append(
                (
                    s,
                    C.interleave(
                        cases(s, dataset_for(s.model, quick), tmp),
                        repeats=min(repeats, s.max_repeats or repeats),
                    ),
                )
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _label(s: Setting) -> str:
    return s.model + (" (unrolled)" if s.unroll else "")


def rows(results, mem: dict, batch: int) -> list[list]:
    """One row per case; estimator rows compare with the ceiling at the same IPL, the other
    rows with the ceiling at the group's largest IPL."""
    out = []
    for i, (s, times) in enumerate(results):
        best = f"ceiling@{s.ipls[-1]}"
        for name, runs in times.items():
            kind, _, ipl = name.partition("@")
            ref = f"ceiling@{ipl}" if kind == "estimator" else best
            per_step = [t.per_step for t in runs]
            wall = [t.wall for t in runs]
            fixed = statistics.median(t.wall - s.steps * t.per_step for t in runs)
            m, m_ref = mem.get(f"{i}:{name}"), mem.get(f"{i}:{ref}")
            out.append(
                [
                    _label(s),
                    ipl or "—",
                    kind,
                    batch / statistics.median(per_step),
                    C.median_ratio([t.per_step for t in times[ref]], per_step),
                    C.median_ratio([t.wall for t in times[ref]], wall),
                    fixed if kind == "estimator" else None,
                    max(t.compiles for t in runs) if kind == "estimator" else None,
                    m,
                    None if m is None or not m_ref else m / m_ref,
                ]
            )
    return out


COLUMNS = [
    "model",
    "IPL",
    "loop",
    "examples/s",
    "ratio to ceiling",
    "whole call",
    "fixed s/call",
    "compiles/call",
    "peak MiB",
    "memory / ceiling",
]


def main(argv: list[str] | None = None) -> str:
    started = C.start(__doc__, argv, probe)
    if started is None:
        return ""
    args, repeats = started
    results = measure(args.quick, repeats)
    mem = C.probe_all(
        __spec__.name, probe_keys(args.quick), quick=args.quick, skip=args.no_memory or args.quick
    )
    batch = global_batch(args.quick)
    notes = [
        f"Global batch {batch}, adam, {repeats} interleaved repeats (at most 3 for the rolled "
        "CNN); every number is a median "
        "over repeats, each ratio taken within one repeat. Estimator rows compare with the "
        "ceiling at the same IPL; ceiling and per-step rows with the ceiling at the largest IPL.",
        "examples/s and 'ratio to ceiling': steady state, between the first and last loop "
        "end of each run. 'whole call': the whole run's wall time, so the estimator's start "
        "and its final checkpoint count ('fixed s/call'). 'compiles/call': XLA compilations "
        "during a timed train call (max over repeats), after a two-loop warm-up.",
        "Peak MiB: growth of peak host RSS over the baseline, each probed case in a fresh "
        "process (largest IPL and per-step only).",
    ]
    return C.report("Training throughput", COLUMNS, rows(results, mem, batch), notes)


if __name__ == "__main__":
    main()
