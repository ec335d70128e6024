"""What each trainer feature costs in the estimator, against the same feature written by hand.

Run from the repository root::

    python -m benchmarks.feature_costs [--quick] [--repeats N]

One run times 14 cases, interleaved: the estimator plain and with each feature
(``compute_dtype="bfloat16"``, ``num_microbatches=4``, ``ExponentialMovingAverage.apply``,
a ``host_call`` of two scalars every step, ``shard_optimizer_state`` (ZeRO-1),
``shard_params`` (FSDP)), and ``_hand_written``'s loops, plain and with the same feature as a
JAX user writes it (bf16 casts in the loss, a micro-batch ``scan``, a shadow update, metrics
returned with the loop and written by tensorboardX, a flattened reduce-scatter / all-gather
ZeRO-1 and FSDP). Same MLP (64-512-512-10), Adam, global batch 256, ``iterations_per_loop``
100, 300 steps per timed call; steady-state examples/s (between the first and the last loop
end of each call), medians of per-repeat ratios.

Columns: each side's throughput with the feature and its ratio to its own plain loop (what
the feature costs there), ``estimator / hand-written`` (the two throughputs with the feature)
and ``/ plain's`` (that ratio over the plain row's: 1 means the estimator's feature costs
what the hand-written one does; below 1, it costs more). Before timing, each hand-written
loop's losses over its first loop are checked against the plain loop's (the same training,
not only the same shape of work).

Every case runs on every device of this process; the data is staged on the device for the
hand-written side and fed by ``input_fn`` to the estimator, as in ``train_throughput``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

import estimator
from benchmarks import _common as C
from benchmarks import _hand_written as H
from benchmarks import _workloads as W
from benchmarks import ema_overhead


class Feature(NamedTuple):
    """An estimator row: ``TPUConfig`` arguments and model params (``ema``, ``host_call``),
    and the hand-written variant it is compared with."""

    tpu: dict
    params: dict
    hand: str


FEATURES: dict[str, Feature] = {
    "plain": Feature({}, {}, "plain"),
    "bf16 compute": Feature({"compute_dtype": "bfloat16"}, {}, "bf16"),
    "4 micro-batches": Feature({"num_microbatches": H.MICROBATCHES}, {}, "microbatches"),
    "moving average": Feature({}, {"ema": True}, "ema"),
    "host_call every step": Feature({}, {"host_call": True}, "host_call"),
    "ZeRO-1": Feature({"shard_optimizer_state": True}, {}, "zero1"),
    "FSDP": Feature({"shard_params": True}, {}, "fsdp"),
}
# How far a variant's first-loop losses may be from the plain loop's (relative).
LOSS_TOLERANCE = {"bf16": 5e-2}
DEFAULT_TOLERANCE = 1e-3


def sizes(quick: bool) -> dict:
    if quick:
        return {"batch": 64, "ipl": 2, "steps": 4}
    return {"batch": 256, "ipl": 100, "steps": 300}


def make_estimator(model_dir: str, f: Feature, size: dict) -> estimator.TPUEstimator:
    """``_workloads.make_estimator``'s configuration (TF's defaults) with the feature on."""
    config = estimator.RunConfig(
        model_dir=model_dir,
        tpu_config=estimator.TPUConfig(iterations_per_loop=size["ipl"], **f.tpu),
        compilation_cache_dir=False,
        progress_bar=False,
        resume_input_position=False,
    )
    return estimator.TPUEstimator(
        ema_overhead.model_fn,
        config=config,
        params={"model": "mlp", **f.params},
        train_batch_size=size["batch"],
    )


def estimator_case(f: Feature, data: W.Dataset, size: dict, model_dir: str) -> Callable:
    est = make_estimator(model_dir, f, size)
    input_fn = W.input_fn_for(data, cycle=True)
    C.warm_up(est, input_fn, size["ipl"])
    return lambda: C.timed_train(est, input_fn, size["steps"])


def hand_case(
    variant: str, data: W.Dataset, size: dict, first_losses: dict, logdir: str
) -> Callable:
    """The hand-written loop of ``variant``, compiled; its first loop's losses go into
    ``first_losses`` (checked by ``check_losses``)."""
    mesh = W.make_mesh()
    loop = H.make("mlp", variant, mesh, data.x[0], logdir=logdir)
    chunks = W.stage_chunks(data, size["ipl"], mesh)
    state, out = loop.run(loop.init(), *chunks[0])  # compiles
    first_losses[variant] = np.asarray(out[0] if variant == "host_call" else out)
    box = [state]
    ipl, steps = size["ipl"], size["steps"]

    def run() -> C.Timing:
        stamps = [C.now()]
        for i in range(steps // ipl):
            box[0], out = loop.run(box[0], *chunks[i % len(chunks)])
            if loop.after is not None:
                loop.after(out, i * ipl + 1)  # copies the metrics to the host: waits
            jax.block_until_ready(out)
            stamps.append(C.now())
        return C.Timing(stamps[-1] - stamps[0], C.steady_per_step(stamps[1:], steps - ipl))

    return run


def check_losses(first_losses: dict) -> None:
    """Each variant trained like the plain loop (else its timing compares unlike work)."""
    plain = first_losses["plain"]
    for variant, losses in first_losses.items():
        tol = LOSS_TOLERANCE.get(variant, DEFAULT_TOLERANCE)
        if not np.allclose(losses, plain, rtol=tol, atol=tol):
            worst = float(np.max(np.abs(losses - plain)))
            raise AssertionError(
                f"hand-written {variant!r} does not train like plain: first-loop losses "
                f"differ by up to {worst:.3g} (tolerance {tol})"
            )


def rows(quick: bool, repeats: int, tmp: str) -> tuple[list[list], dict]:
    size = sizes(quick)
    data = W.make_dataset("mlp", batches=size["ipl"], global_batch=size["batch"])
    first: dict = {}
    cases = {}
    for i, (name, f) in enumerate(FEATURES.items()):
        cases[f"est:{name}"] = estimator_case(f, data, size, f"{tmp}/{i}")
        cases[f"hand:{name}"] = hand_case(f.hand, data, size, first, f"{tmp}/hand{i}")
    check_losses(first)
    times = C.interleave(cases, repeats=repeats)

    def steps(key):
        return [t.per_step for t in times[key]]

    out = []
    base = C.median_ratio(steps("hand:plain"), steps("est:plain"))
    for name in FEATURES:
        ours, hand = steps(f"est:{name}"), steps(f"hand:{name}")
        ratio = C.median_ratio(hand, ours)
        out.append(
            [
                name,
                C.throughput(size["batch"], hand),
                C.median_ratio(steps("hand:plain"), hand),
                C.throughput(size["batch"], ours),
                C.median_ratio(steps("est:plain"), ours),
                ratio,
                ratio / base,
            ]
        )
    return out, size


def probe(case: str, quick: bool) -> None:  # no fresh-process probes
    raise SystemExit(f"no probe {case!r}")


def main(argv=None) -> str | None:
    started = C.start(__doc__, argv, probe, default_repeats=3)
    if started is None:
        return None
    args, repeats = started
    with tempfile.TemporaryDirectory(prefix="bench_feature_costs_") as tmp:
        table, size = rows(args.quick, repeats, tmp)
    return C.report(
        "Trainer features: the estimator against the same feature written by hand",
        [
            "feature",
            "hand-written examples/s",
            "hand-written vs plain",
            "estimator examples/s",
            "estimator vs plain",
            "estimator / hand-written",
            "/ plain's",
        ],
        table,
        [
            f"MLP 64-512-512-10, Adam, global batch {size['batch']}, iterations_per_loop "
            f"{size['ipl']}, {size['steps']} steps per timed call, {repeats} interleaved "
            "repeats; ratios are of throughput (below 1 is slower).",
        ],
    )


if __name__ == "__main__":
    main()
