"""Start-up: time to the first training step and compile counts, with and without the
persistent compilation cache.

Run from the repository root::

    python -m benchmarks.startup [--quick] [--repeats N]

Every measurement is a fresh Python process (the cache persists across processes, and a
process that has compiled once would hide the cost). Each process imports everything and
builds the numpy data, then starts the clock and:

* ``hand-written``: builds the mesh, initialises params and adam state, compiles the ceiling
  ``jit(shard_map(scan))`` loop and runs two one-step loops;
* ``estimator``: constructs a ``TPUEstimator`` (``iterations_per_loop=1``) and calls
  ``train(input_fn, steps=2)``; a hook stamps the end of each step; ``train`` returns after
  its checkpoint is written. The second step shows any recompilation.

Three cache modes, interleaved per repeat: ``off``; ``cold`` (an empty cache directory, so
everything compiles and is written); ``warm`` (a second process on that directory). The
hand-written side turns the cache on exactly as ``RunConfig(compilation_cache_dir=...)``
does (``jax_compilation_cache_dir`` and both persistent-cache thresholds at 0).
XLA compiles are counted with ``jax.monitoring`` (``backend_compile_duration`` events minus
persistent-cache hits).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile

import jax

from benchmarks import _common as C
from benchmarks import _workloads as W

MODEL = "mlp"
MODES = ("off", "cold", "warm")
LOOPS = ("hand-written", "estimator")
STEPS = 2  # two loops of one step each: the second shows any recompilation


def batch(quick: bool) -> int:
    return 32 if quick else 256


def _enable_cache(cache_dir: str) -> None:
    """What ``RunConfig(compilation_cache_dir=...)`` does (estimator/core/runtime.py)."""
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _hand_written(data: W.Dataset, cache_dir: str | None, start: float) -> dict:
    if cache_dir:
        _enable_cache(cache_dir)
    mesh = W.make_mesh()
    state = W.init_state(MODEL, mesh, data.x[0])
    loop = W.ceiling_loop(MODEL, mesh, unroll=False)
    ((xs, ys),) = W.stage_chunks(data, 1, mesh)
    stamps = []
    for _ in range(STEPS):
        state, losses = loop(state, xs, ys)
        jax.block_until_ready(losses)
        stamps.append(C.now())
    return {
        "first_step_s": stamps[0] - start,
        "second_step_s": stamps[1] - stamps[0],
        "returns_s": stamps[-1] - start,
    }


def _estimator(data: W.Dataset, cache_dir: str | None, start: float, tmp: str) -> dict:
    est = W.make_estimator(
        MODEL,
        tmp,
        global_batch=data.global_batch,
        iterations_per_loop=1,
        compilation_cache_dir=cache_dir or False,
    )
    timer = C.LoopTimer()
    est.train(W.input_fn_for(data, cycle=True), steps=STEPS, hooks=[timer])
    return {
        "first_step_s": timer.stamps[0] - start,
        "second_step_s": timer.stamps[1] - timer.stamps[0],
        "returns_s": C.now() - start,
    }


def probe(key: str, quick: bool) -> None:
    """One start-up in this fresh process; ``key`` is ``loop:cache_dir`` (``-``: no cache)."""
    loop, cache_dir = key.split(":", 1)
    cache_dir = None if cache_dir == "-" else cache_dir
    data = W.make_dataset(MODEL, batches=1, global_batch=batch(quick))
    mem = C.MemoryProbe()
    mem.start()
    tmp = tempfile.mkdtemp(prefix="bench_startup_")
    try:
        with C.CompileCounter().active() as counter:
            start = C.now()
            if loop == "estimator":
                out = _estimator(data, cache_dir, start, tmp)
            else:
                out = _hand_written(data, cache_dir, start)
        C.print_probe_result(
            {
                **out,
                **mem.result(),
                "compiles": counter.compiled,
                "cache_hits": counter.cache_hits,
                "compile_s": counter.seconds,
            }
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(loop: str, cache_dir: str | None, quick: bool) -> dict:
    start = C.now()
    out = C.run_probe(__spec__.name, f"{loop}:{cache_dir or '-'}", ["--quick"] if quick else [])
    return {**out, "process_s": C.now() - start}


def measure(quick: bool, repeats: int, loops: tuple[str, ...], modes: tuple[str, ...]) -> dict:
    """``{(loop, mode): [result per repeat]}``, interleaved loop by loop, mode by mode."""
    out: dict = {(loop, mode): [] for loop in loops for mode in modes}
    tmp = tempfile.mkdtemp(prefix="bench_cache_")
    try:
        for _ in range(repeats):
            for loop in loops:
                cache_dir = tempfile.mkdtemp(dir=tmp)
                for mode in modes:
                    out[(loop, mode)].append(
                        _run(loop, None if mode == "off" else cache_dir, quick)
                    )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def rows(results: dict, loops: tuple[str, ...], modes: tuple[str, ...]) -> list[list]:
    out = []
    for mode in modes:
        ref = results.get(("hand-written", mode))
        for loop in loops:
            runs = results[(loop, mode)]
            out.append(
                [
                    loop,
                    mode,
                    _med(runs, "first_step_s"),
                    _med(runs, "second_step_s"),
                    _med(runs, "returns_s"),
                    _med(runs, "process_s"),
                    f"{int(_med(runs, 'compiles'))} ({int(_med(runs, 'cache_hits'))} cache hits)",
                    _med(runs, "compile_s"),
                    None
                    if ref is None
                    else C.median_ratio(
                        [r["first_step_s"] for r in ref], [r["first_step_s"] for r in runs]
                    ),
                    None
                    if ref is None
                    else statistics.median(
                        o["first_step_s"] - r["first_step_s"]
                        for o, r in zip(runs, ref, strict=True)
                    ),
                    _med(runs, "peak_mib"),
                ]
            )
    return out


COLUMNS = [
    "loop",
    "compilation cache",
    "first step s",
    "second step s",
    "train returns s",
    "process s",
    "XLA compiles",
    "compile s",
    "ratio to hand-written",
    "first step s minus hand-written",
    "peak MiB",
]


def main(argv: list[str] | None = None) -> str:
    started = C.start(__doc__, argv, probe, default_repeats=3)
    if started is None:
        return ""
    args, repeats = started
    # --quick: only the estimator's cold and warm start (two processes)
    loops, modes = (("estimator",), ("cold", "warm")) if args.quick else (LOOPS, MODES)
    results = measure(args.quick, repeats, loops, modes)
    notes = [
        f"MLP, global batch {batch(args.quick)}, iterations_per_loop 1, 2 steps; {repeats} "
        "repeats, medians. Times from after imports and data (clock start) to the end of the first "
        "step, from there to the end of the second, and to train's return (after its "
        "checkpoint); 'process s' is the whole process, Python and JAX imports included.",
        "'ratio to hand-written' = hand-written first-step time / this one (same cache mode); "
        "'minus hand-written': this first-step time less the hand-written one, same repeat "
        "(the target: under +1 s cold, below 0 warm).",
        "Peak MiB: growth of peak host RSS over the baseline in that process.",
        f"Python {sys.version.split()[0]}; subprocess timeout 600 s.",
    ]
    return C.report("Start-up", COLUMNS, rows(results, loops, modes), notes)


if __name__ == "__main__":
    try:
        main()
    except subprocess.TimeoutExpired as e:
        raise SystemExit(f"a start-up process timed out: {e}") from e
