"""Peak memory against iterations_per_loop; host memory over repeated evaluate calls.

Run from the repository root::

    python -m benchmarks.memory_vs_ipl [--quick] [--no-memory]   # ~10 min

It trains an image model (32x32x3 images, a strided conv, global batch 64: 768 KiB of
input per step, 96 KiB per device) for the same 2,000 steps at ``iterations_per_loop`` 1, 10,
100 and 1,000, each case in a fresh process, and reports the growth of the peak resident set
(on GPU/TPU: the device's ``peak_bytes_in_use``), the steady-state throughput and the calls
each loop ran as. The first four rows use the default budget (on CPU 2 MiB per process, so
256 KiB per device with 8 simulated devices: calls of at most 2 steps here, whatever the
loop's length). The last two set the accelerators' default, 256 MiB per device, on CPU:
every loop here then fits one call, which is how every loop was staged before the budget
existed.

Then it evaluates the same model 50 times in one process and reports the resident set after
calls 1, 5, 10, 25 and 50 (a process that starts threads per call grows there).
"""

from __future__ import annotations

import shutil
import tempfile
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import estimator
import metrics
from benchmarks import _common as C
from estimator.data import plan

SHAPE = (32, 32, 3)
CLASSES = 10
MIB = 2**20


class ImageNet(nn.Module):
    """A strided 4x4 conv (patches), ReLU, global average pool, dense: cheap per step."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(32, (4, 4), strides=(4, 4))(x))
        return nn.Dense(CLASSES)(x.mean(axis=(1, 2)))


def _metric_fn(labels, logits):
    return {"accuracy": metrics.accuracy(labels, logits.argmax(-1))}


def model_fn(features, labels, mode, params):
    logits = ImageNet()(features)
    per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    mask = estimator.padding_mask()
    loss = (per_row * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    return estimator.TPUEstimatorSpec(
        mode,
        loss=loss,
        train_op=optax.adam(1e-3) if mode == estimator.ModeKeys.TRAIN else None,
        eval_metrics=(_metric_fn, [labels, logits]),
    )


def input_fn_for(batches: int, *, distinct: int = 16):
    """``batches`` batches cycling over ``distinct`` random ones (data generation stays cheap)."""

    def input_fn(params):
        b = params["batch_size"]
        rng = np.random.RandomState(0)
        xs = rng.randn(distinct, b, *SHAPE).astype(np.float32)
        ys = rng.randint(0, CLASSES, (distinct, b)).astype(np.int32)
        for i in range(batches):
            yield xs[i % distinct], ys[i % distinct]

    return input_fn


class Case(NamedTuple):
    ipl: int
    budget_mib: float | None  # None: the default


def sizes(quick: bool) -> tuple[int, int]:
    """(global batch, training steps)."""
    return (16, 8) if quick else (64, 2000)


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case(1, None), Case(4, 1.0)]
    default = [Case(ipl, None) for ipl in (1, 10, 100, 1000)]
    return default + [Case(100, 256.0), Case(1000, 256.0)]


def default_budget_mib() -> float:
    """The default budget per device on this machine's devices, in MiB."""
    devices = jax.local_devices()
    return plan.input_budget(None, platform=devices[0].platform, local_devices=len(devices)) / MIB


def make_estimator(model_dir: str, case: Case, batch: int) -> estimator.TPUEstimator:
    tpu = {"iterations_per_loop": case.ipl}
    if case.budget_mib is not None:
        tpu["max_staged_input_bytes"] = int(case.budget_mib * MIB)
    config = estimator.RunConfig(
        model_dir=model_dir,
        tpu_config=estimator.TPUConfig(**tpu),
        progress_bar=False,
        save_checkpoints_steps=10**9,
        save_summary_steps=0,
        log_step_count_steps=0,
    )
    return estimator.TPUEstimator(
        model_fn, config=config, train_batch_size=batch, eval_batch_size=batch
    )


class CallSizes:
    """Records the steps of every compiled call (wraps the dispatcher's launch)."""

    def __init__(self):
        from estimator.driver import dispatch

        self.steps: list[int] = []
        self._dispatch = dispatch
        self._original = dispatch.dispatch

        def spy(calls, *, launch, fetch, **options):
            def counted(chunk):
                self.steps.append(chunk.steps)
                return launch(chunk)

            return self._original(calls, launch=counted, fetch=fetch, **options)

        dispatch.dispatch = spy

    def close(self) -> None:
        self._dispatch.dispatch = self._original


def run_case(case: Case, quick: bool, mem: C.MemoryProbe | None = None) -> dict:
    """Trains one case: peak memory (with ``mem``), steady throughput and call lengths."""
    batch, steps = sizes(quick)
    model_dir = tempfile.mkdtemp(prefix="bench_mem_")
    try:
        input_fn = input_fn_for(steps)
        if mem is not None:
            mem.start()
        est = make_estimator(model_dir, case, batch)
        spy, timer = CallSizes(), C.LoopTimer()
        try:
            est.train(input_fn, max_steps=steps, hooks=[timer])
        finally:
            spy.close()
        result = mem.result() if mem is not None else {"peak_mib": None}
        per_step = timer.per_step() if len(timer.stamps) > 1 else None
        result["examples_per_s"] = batch / per_step if per_step else None
        result["calls"] = sorted(set(spy.steps), reverse=True)
        return result
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def probe(key: str, quick: bool) -> None:
    """One case in a fresh process."""
    C.print_probe_result(run_case(cases(quick)[int(key)], quick, C.MemoryProbe()))


def evaluate_memory(quick: bool) -> str:
    """RSS after repeated evaluate calls on one estimator, in this process (a note line)."""
    batch, _ = sizes(quick)
    calls = 3 if quick else 50
    marks = (1, 2, 3) if quick else (1, 5, 10, 25, 50)
    model_dir = tempfile.mkdtemp(prefix="bench_mem_eval_")
    try:
        est = make_estimator(model_dir, Case(10, None), batch)
        est.train(input_fn_for(10), max_steps=10)
        eval_fn = input_fn_for(4 if quick else 100)
        rss = {}
        for i in range(1, calls + 1):
            est.evaluate(eval_fn)
            if i in marks:
                rss[i] = C.rss_mib()
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    points = ", ".join(f"{rss[i]:.0f} MiB after call {i}" for i in marks)
    return (
        f"Repeated evaluate ({calls} calls of {4 if quick else 100} batches, one estimator, "
        f"one process): resident set {points}; growth {rss[marks[-1]] - rss[marks[0]]:+.1f} "
        f"MiB over all calls, {rss[marks[-1]] - rss[marks[1]]:+.1f} MiB after call {marks[1]}."
    )


def main(argv: list[str] | None = None) -> str:
    started = C.start(__doc__, argv, probe, default_repeats=1)
    if started is None:
        return ""
    args, _ = started
    batch, steps = sizes(args.quick)
    rows = []
    results = {}
    for i, case in enumerate(cases(args.quick)):
        if args.no_memory or args.quick:  # in this process, no memory number
            results[i] = run_case(case, args.quick)
        else:
            results[i] = C.run_probe(__spec__.name, str(i))
    base = results.get(0, {}).get("peak_mib")
    default_mib = default_budget_mib()
    for i, case in enumerate(cases(args.quick)):
        r = results.get(i, {})
        peak = r.get("peak_mib")
        budget = f"default ({default_mib:g})" if case.budget_mib is None else f"{case.budget_mib:g}"
        calls = r.get("calls")
        rows.append(
            [
                case.ipl,
                budget,
                " / ".join(map(str, calls)) if calls else None,
                peak,
                None if peak is None or not base else peak / base,
                r.get("examples_per_s"),
            ]
        )
    eval_note = evaluate_memory(args.quick)
    text = C.report(
        "Peak memory against iterations_per_loop",
        ["IPL", "budget MiB/device", "call lengths", "peak MiB", "peak / IPL 1", "examples/s"],
        rows,
        [
            f"Image model: 32x32x3 float32 images, global batch {batch} "
            f"({batch * int(np.prod(SHAPE)) * 4 / MIB:.2f} MiB of input per step), "
            f"{steps} training steps per case, "
            + (
                "each case in this process (no memory numbers)."
                if args.quick or args.no_memory
                else "each case in a fresh process."
            ),
            "Peak MiB: growth of peak host RSS over the baseline (device peak_bytes_in_use on "
            "GPU/TPU). 'call lengths': the distinct compiled call lengths the loops ran as. "
            "'peak / IPL 1' compares with the first row; examples/s is steady state, "
            "between the first and the last loop.",
            eval_note,
        ],
    )
    return text


if __name__ == "__main__":
    main()
