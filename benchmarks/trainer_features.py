"""Trainer features against the plain train step: bf16 compute, micro-batches (and more rows).

Run from the repository root::

    python -m benchmarks.trainer_features [--quick] [--repeats N]

Throughput: one ``TPUEstimator`` per row of ``FEATURES`` on every device, the same MLP
(64-512-512-10, Adam), the same batches (global batch 256), ``iterations_per_loop`` 100;
steady-state examples/s (median over interleaved repeats, timed between the first and the
last device loop of each ``train`` call) and its ratio to ``plain`` within each repeat.
Rows: ``plain``; ``compute_dtype=bfloat16`` (the policy) and ``bf16 by hand`` (the same MLP
written with ``dtype=jnp.bfloat16`` layers, the target: the policy no slower than it);
``num_microbatches=4``; then ``plain`` and ``num_microbatches=4`` at 8x and 16x the global
batch (2048 and 4096: micro-batches of 64 and 128 rows a replica, where accumulation is
used), each row compared with ``plain`` at its batch. A row is one entry of ``FEATURES``
(``TPUConfig`` arguments and model params), so adding a feature's row is one line.

Micro-batches against hand-written accumulation: the same MLP trained by a hand-written
``jit(shard_map(scan(step)))`` loop (``_workloads``' ceiling), plain and with its step's
gradient summed over 4 micro-batches by a ``lax.scan`` (what a user would write), timed in
the same interleaved repeats; ``hand-written vs plain`` is what accumulation costs at all on
this machine, ``estimator / hand-written`` what the estimator's micro-batches add to that.

Memory: a large-activation model (an MLP 64-512x4-10 on a global batch of 32768, 4096 rows
per replica, so the activations, 8 MiB a layer, dwarf the 0.8 M parameters) compiled with
``num_microbatches`` 1, 2, 4, 8; the train loop's ``temp_size_in_bytes`` from XLA's
``memory_analysis()`` per device (activations and gradients live during the step: the figure
micro-batches shrink; device-independent, since it is what the compiler allocates, not what
a process happened to touch).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import estimator
from benchmarks import _common as C
from benchmarks import _workloads as W
from benchmarks import train_throughput as T


class Feature(NamedTuple):
    """One throughput row: ``TPUConfig`` arguments, model params (read by ``_model_fn``) and
    the global batch as a multiple of the default one (compared with ``plain`` at it)."""

    tpu: dict
    params: dict = {}
    batch_times: int = 1


# Micro-batches are for batches too large for a step: the second and third pairs run them
# where each micro-batch is 64 and 128 rows a replica (global batch 2048 and 4096), not 8.
FEATURES: dict[str, Feature] = {
    "plain": Feature({}),
    "compute_dtype=bfloat16": Feature({"compute_dtype": "bfloat16"}),
    "bf16 by hand (dtype=)": Feature({}, {"dtype": "bfloat16"}),
    "num_microbatches=4": Feature({"num_microbatches": 4}),
    "plain, batch x8": Feature({}, {}, 8),
    "num_microbatches=4, batch x8": Feature({"num_microbatches": 4}, {}, 8),
    "plain, batch x16": Feature({}, {}, 16),
    "num_microbatches=4, batch x16": Feature({"num_microbatches": 4}, {}, 16),
}
IPL = 100
FEATURES_IN, CLASSES = 64, 10


def sizes(quick: bool) -> dict:
    if quick:
        return {"hidden": 512, "batch": 64, "ipl": 2, "batches": 4, "steps": 4}
    return {"hidden": 512, "batch": 256, "ipl": IPL, "batches": 20, "steps": 3 * IPL}


def memory_sizes(quick: bool) -> dict:
    if quick:
        return {"hidden": 64, "layers": 2, "features": 64, "batch": 4096, "ks": (1, 4)}
    return {"hidden": 512, "layers": 4, "features": 64, "batch": 32768, "ks": (1, 2, 4, 8)}


def _model_fn(features, labels, mode, params):
    dtype = jnp.dtype(params["dtype"]) if params.get("dtype") else None
    h = features
    for _ in range(params.get("layers", 2)):
        h = nn.relu(nn.Dense(params["hidden"], dtype=dtype)(h))
    logits = nn.Dense(CLASSES, dtype=dtype)(h).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.adam(1e-3))


def _data(batches: int, batch: int, features: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(0)
    x = rng.randn(batches, batch, features).astype(np.float32)
    y = rng.randint(0, CLASSES, (batches, batch)).astype(np.int32)
    return x, y


def _input_fn(x: np.ndarray, y: np.ndarray) -> Callable:
    def input_fn(params):
        while True:
            for b in range(len(x)):
                yield x[b], y[b]

    return input_fn


def make_estimator(model_dir: str, *, ipl: int, batch: int, tpu: dict, params: dict):
    config = estimator.RunConfig(
        model_dir=model_dir,
        tpu_config=estimator.TPUConfig(iterations_per_loop=ipl, **tpu),
        progress_bar=False,
        resume_input_position=False,
        save_summary_steps=0,
        log_step_count_steps=0,
    )
    return estimator.TPUEstimator(_model_fn, config=config, params=params, train_batch_size=batch)


def hand_written_case(size: dict, batch: int, k: int) -> Callable[[], C.Timing]:
    """``train_throughput``'s ceiling case: ``_workloads``' MLP (64-512-512-10, this model at
    ``hidden`` 512) in its ``jit(shard_map(scan))`` loop, with ``k`` micro-batches a step."""
    data = W.make_dataset("mlp", batches=size["ipl"], global_batch=batch)
    setting = T.Setting("mlp", False, (size["ipl"],), size["steps"])
    return T.ceiling_case(setting, size["ipl"], data, num_microbatches=k)


#: Micro-batch rows compared with hand-written accumulation: (estimator row, its plain row).
MICRO = (
    ("num_microbatches=4", "plain"),
    ("num_microbatches=4, batch x8", "plain, batch x8"),
    ("num_microbatches=4, batch x16", "plain, batch x16"),
)


def _hand_name(row: str) -> str:
    return f"hand-written: {row}"


def throughput_rows(quick: bool, repeats: int, tmp: str) -> tuple[list[list], dict]:
    size = sizes(quick)
    batches = {f.batch_times * size["batch"] for f in FEATURES.values()}
    input_fns = {b: _input_fn(*_data(size["batches"], b, FEATURES_IN)) for b in batches}

    def batch_of(f: Feature) -> int:
        return f.batch_times * size["batch"]

    ests = {
        name: make_estimator(
            f"{tmp}/{i}",
            ipl=size["ipl"],
            batch=batch_of(f),
            tpu=f.tpu,
            params={"hidden": size["hidden"], **f.params},
        )
        for i, (name, f) in enumerate(FEATURES.items())
    }
    for name, est in ests.items():
        C.warm_up(est, input_fns[batch_of(FEATURES[name])], size["ipl"])
    fns = {k: input_fns[batch_of(FEATURES[k])] for k in ests}
    cases = {k: (lambda e=e, k=k: C.timed_train(e, fns[k], size["steps"])) for k, e in ests.items()}
    for row in {r for pair in MICRO for r in pair}:  # the same step written by hand
        f = FEATURES[row]
        k = f.tpu.get("num_microbatches", 1)
        cases[_hand_name(row)] = hand_written_case(size, batch_of(f), k)
    times = C.interleave(cases, repeats=repeats)
    plain = {f.batch_times: name for name, f in FEATURES.items() if not f.tpu and not f.params}
    rows = []
    for name, f in FEATURES.items():
        per_step = [t.per_step for t in times[name]]
        base = [t.per_step for t in times[plain[f.batch_times]]]
        rows.append(
            [name, batch_of(f) / statistics.median(per_step), C.median_ratio(base, per_step)]
        )
    return rows, size, micro_rows(times, size)


def micro_rows(times: dict, size: dict) -> list[list]:
    """Each micro-batch row: hand-written accumulation vs its plain loop, ours vs plain, and
    ours over hand-written (1 = the estimator adds nothing to what accumulation costs)."""

    def steps(name):
        return [t.per_step for t in times[name]]

    out = []
    for ours, plain in MICRO:
        f, hand = FEATURES[ours], _hand_name(ours)
        batch = f.batch_times * size["batch"]
        out.append(
            [
                batch,
                batch // jax.device_count() // f.tpu["num_microbatches"],
                batch / statistics.median(steps(hand)),
                C.median_ratio(steps(_hand_name(plain)), steps(hand)),
                C.median_ratio(steps(plain), steps(ours)),
                C.median_ratio(steps(hand), steps(ours)),
            ]
        )
    return out


def loop_temp_bytes(k: int, size: dict, model_dir: str) -> int:
    """Per-device temporary bytes of the compiled train loop with ``num_microbatches=k``."""
    x, y = _data(1, size["batch"], size["features"])
    est = make_estimator(
        model_dir,
        ipl=1,
        batch=size["batch"],
        tpu={"num_microbatches": k},
        params={"hidden": size["hidden"], "layers": size["layers"]},
    )
    est.train(_input_fn(x, y), steps=1)  # the live state the loop is lowered for
    state = est._job.store.last.state
    loop = est._job.programs.train_for(state, size["batch"] // est.num_replicas)
    sharding = NamedSharding(est.mesh, P(None, "data"))
    xs = jax.ShapeDtypeStruct((1, size["batch"], size["features"]), jnp.float32, sharding=sharding)
    ys = jax.ShapeDtypeStruct((1, size["batch"]), jnp.int32, sharding=sharding)
    return int(loop.lower(state, xs, ys).compile().memory_analysis().temp_size_in_bytes)


def memory_rows(quick: bool, tmp: str) -> tuple[list[list], dict]:
    size = memory_sizes(quick)
    temps = {k: loop_temp_bytes(k, size, f"{tmp}/mem{k}") for k in size["ks"]}
    return [[k, temps[k] / 2**20, temps[1] / temps[k]] for k in size["ks"]], size


def probe(case: str, quick: bool) -> None:  # no fresh-process probes: memory is compiled
    raise SystemExit(f"no probe {case!r}")


def main(argv=None) -> str | None:
    started = C.start(__doc__, argv, probe, default_repeats=3)
    if started is None:
        return None
    args, repeats = started
    tmp = tempfile.mkdtemp(prefix="bench_features_")
    try:
        rows, size, micro = throughput_rows(args.quick, repeats, tmp)
        mem_rows, mem = memory_rows(args.quick, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    notes = [
        f"MLP {FEATURES_IN}-{size['hidden']}-{size['hidden']}-{CLASSES}, Adam, global batch "
        f"{size['batch']}, iterations_per_loop {size['ipl']}, {size['steps']} steps per timed "
        f"call, {repeats} interleaved repeats.",
    ]
    text = C.report(
        "Trainer features against the plain step",
        ["feature", "examples/s", "vs plain"],
        rows,
        notes,
    )
    text += "\n" + C.report(
        "Micro-batches against hand-written accumulation",
        [
            "global batch",
            "micro-batch rows/replica",
            "hand-written examples/s",
            "hand-written vs plain",
            "estimator vs plain",
            "estimator / hand-written",
        ],
        micro,
        [
            "Both sides: 4 micro-batches per step, gradients summed by a scan; throughput "
            "ratios (below 1 is slower); the last column is the estimator's over the "
            "hand-written accumulation's throughput."
        ],
    )
    width = "x".join([str(mem["hidden"])] * mem["layers"])
    text += "\n" + C.report(  # print() ended the first table with one newline
        "Micro-batches: train-loop temporary memory per device",
        ["num_microbatches", "temp MiB/device", "reduction vs 1"],
        mem_rows,
        [
            f"MLP {mem['features']}-{width}-{CLASSES}, global batch {mem['batch']}; XLA "
            "memory_analysis().temp_size_in_bytes of the compiled train loop."
        ],
    )
    return text


if __name__ == "__main__":
    main()
