"""Optimizer state and parameters split over replicas: throughput and bytes per device.

Run from the repository root::

    python -m benchmarks.sharded_state [--quick] [--repeats N] [--no-memory]

One ``TPUEstimator`` per layout on every device, the same model_fn (an MLP, 64-1024-1024-10
with Adam: 1.1 M parameters, 4.3 MiB, and 8.6 MiB of Adam state), the same batches (global
batch 128), at ``iterations_per_loop`` 100:

* ``replicated``: every replica holds all parameters and all optimizer state (the default);
* ``shard_optimizer_state``: ZeRO-1/2, gradients reduce-scattered, 1/R of the Adam state each;
* ``shard_params``: ZeRO-3 / FSDP, the parameters split too, gathered for each step.

Columns: steady-state examples/s (median over interleaved repeats, timed between the first
and the last device loop of each ``train`` call) and its ratio to ``replicated`` within each
repeat; the bytes one device holds of the parameters and of the optimizer state between steps
(the shards of the live state); and the compiled train loop's bytes per device from XLA's
``memory_analysis()`` (arguments + outputs - donated aliases + temporaries: the program's peak
on one device, activations and gradients included). With ``--no-memory`` off, each layout
also runs in a fresh process whose peak is measured: ``peak_bytes_in_use`` of device 0 on a
GPU/TPU, host peak RSS growth on CPU (all simulated devices share that one process).

On CPU the eight devices are simulated by one process (``--xla_force_host_platform_device_
count=8``): collectives are memory copies between threads, so the throughput shows the cost
of the extra program structure, not of an interconnect. On a GPU/TPU host run the same
command; every device the process sees is used.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import estimator
from benchmarks import _common as C
from estimator.parallel import zero

LAYOUTS = {
    "replicated": {},
    "shard_optimizer_state": {"shard_optimizer_state": True},
    "shard_params": {"shard_params": True},
}
IPL = 100
FEATURES, CLASSES = 64, 10


def sizes(quick: bool) -> dict:
    if quick:
        return {"hidden": 256, "batch": 64, "ipl": 2, "batches": 8, "steps": 4}
    return {"hidden": 1024, "batch": 128, "ipl": IPL, "batches": 20, "steps": 2 * IPL}


def _model_fn(features, labels, mode, params):
    h = features
    for _ in range(2):
        h = nn.relu(nn.Dense(params["hidden"])(h))
    logits = nn.Dense(CLASSES)(h)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.adam(1e-3))


def _data(size: dict) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(0)
    x = rng.randn(size["batches"], size["batch"], FEATURES).astype(np.float32)
    y = rng.randint(0, CLASSES, (size["batches"], size["batch"])).astype(np.int32)
    return x, y


def _input_fn(x: np.ndarray, y: np.ndarray) -> Callable:
    def input_fn(params):
        while True:
            for b in range(len(x)):
                yield x[b], y[b]

    return input_fn


def make_estimator(layout: str, model_dir: str, size: dict) -> estimator.TPUEstimator:
    config = estimator.RunConfig(
        model_dir=model_dir,
        tpu_config=estimator.TPUConfig(iterations_per_loop=size["ipl"], **LAYOUTS[layout]),
        progress_bar=False,
        resume_input_position=False,
        save_summary_steps=0,
        log_step_count_steps=0,
    )
    return estimator.TPUEstimator(
        _model_fn, config=config, params={"hidden": size["hidden"]}, train_batch_size=size["batch"]
    )


def state_bytes(est: estimator.TPUEstimator) -> tuple[int, int]:
    """Bytes one device holds of (params, optimizer state) of the estimator's live state."""
    state = est._job.store.last.state
    return zero.bytes_per_device(state.params), zero.bytes_per_device(state.opt_state)


def program_bytes(est: estimator.TPUEstimator, size: dict) -> int:
    """Per-device bytes of the compiled train loop (XLA ``memory_analysis``)."""
    state = est._job.store.last.state
    loop = est._job.programs.train(size["batch"] // est.num_replicas)
    sharding = NamedSharding(est.mesh, P(None, "data"))
    xs = jax.ShapeDtypeStruct(
        (size["ipl"], size["batch"], FEATURES), jnp.float32, sharding=sharding
    )
    ys = jax.ShapeDtypeStruct((size["ipl"], size["batch"]), jnp.int32, sharding=sharding)
    m = loop.lower(state, xs, ys).compile().memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def probe(layout: str, quick: bool) -> None:
    size = sizes(quick)
    x, y = _data(size)
    mem = C.MemoryProbe()
    mem.start()
    tmp = tempfile.mkdtemp(prefix="bench_probe_")
    try:
        make_estimator(layout, tmp, size).train(_input_fn(x, y), steps=2 * size["ipl"])
        C.print_probe_result(mem.result())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> str | None:
    started = C.start(__doc__, argv, probe, default_repeats=3)
    if started is None:
        return None
    args, repeats = started
    size = sizes(args.quick)
    x, y = _data(size)
    input_fn = _input_fn(x, y)
    tmp = tempfile.mkdtemp(prefix="bench_sharded_")
    try:
        ests = {k: make_estimator(k, f"{tmp}/{k}", size) for k in LAYOUTS}
        for est in ests.values():
            C.warm_up(est, input_fn, size["ipl"])
        times = C.interleave(
            {k: (lambda e=e: C.timed_train(e, input_fn, size["steps"])) for k, e in ests.items()},
            repeats=repeats,
        )
        held = {k: state_bytes(e) for k, e in ests.items()}
        # each a fresh compile of the loop: left out of the smoke run (--quick)
        program = {} if args.quick else {k: program_bytes(e, size) for k, e in ests.items()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # --quick (the smoke test) skips the fresh-process probes: three more processes
    skip = args.no_memory or args.quick
    peaks = C.probe_all("benchmarks.sharded_state", list(LAYOUTS), quick=args.quick, skip=skip)
    base = [t.per_step for t in times["replicated"]]
    rows = []
    for k in LAYOUTS:
        per_step = [t.per_step for t in times[k]]
        mib = [b / 2**20 for b in held[k]]
        rows.append(
            [
                k,
                size["batch"] / statistics.median(per_step),
                C.median_ratio(base, per_step),
                mib[0],
                mib[1],
                program[k] / 2**20 if k in program else None,
                peaks.get(k),
            ]
        )
    columns = [
        "layout",
        "examples/s",
        "vs replicated",
        "params MiB/device",
        "opt state MiB/device",
        "program MiB/device",
        "peak MiB (probe)",
    ]
    params = sum(
        int(np.prod(a.shape))
        for a in jax.tree.leaves(ests["replicated"]._job.store.last.state.params)
    )
    notes = [
        f"MLP {FEATURES}-{size['hidden']}-{size['hidden']}-{CLASSES} ({params:,} parameters), "
        f"Adam, global batch {size['batch']}, iterations_per_loop {size['ipl']}, "
        f"{size['steps']} steps per timed call, {repeats} interleaved repeats.",
        "On CPU the devices are simulated in one process: collectives are copies between "
        "threads, and the probe's peak is the whole process's host RSS growth.",
    ]
    return C.report("Sharded training state", columns, rows, notes)


if __name__ == "__main__":
    main()
