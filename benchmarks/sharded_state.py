"""Optimizer state and parameters split over replicas: throughput and bytes per device.

Run from the repository root::

    python -m benchmarks.sharded_state [--quick] [--repeats N] [--no-memory] [--memory-only]

One ``TPUEstimator`` per layout on every device, the same model_fn (an MLP, 1024-2048-2048-10
with Adam: 6.3 M parameters, 24 MiB, and 48 MiB of Adam state), the same batches (global
batch 128), at ``iterations_per_loop`` 100:

* ``replicated``: every replica holds all parameters and all optimizer state (the default);
* ``shard_optimizer_state``: ZeRO-1/2, gradients reduce-scattered, 1/R of the Adam state each;
* ``shard_params``: ZeRO-3 / FSDP, the parameters split too, each gathered where it is used.

Columns: steady-state examples/s (median over interleaved repeats, timed between the first
and the last device loop of each ``train`` call) and its ratio to ``replicated`` within each
repeat; the bytes one device holds of the parameters and of the optimizer state between steps
(the shards of the live state); the compiled train loop's bytes per device from XLA's
``memory_analysis()`` (arguments, temporaries, and the peak: arguments + outputs - donated
aliases + temporaries, activations and gradients included), that figure times the device
count; and, unless ``--no-memory``, the peak of a fresh process training each layout (two
loops at ``iterations_per_loop`` ``PROBE_IPL`` = 20):
``peak_bytes_in_use`` of device 0 on a GPU/TPU, host peak RSS growth on CPU, where all
simulated devices share the one process (so it compares with the "x devices" column, not
the per-device one). A second table gives the loop's per-device peak at 1x, 2x and 4x the
widths, and at 8 equal hidden layers (compiled on abstract state, nothing allocated):
replicated grows with the whole model, the split layouts with 1/R of it plus the layer in
use. ``--memory-only`` skips the timing.

On CPU the eight devices are simulated by one process (``--xla_force_host_platform_device_
count=8``): collectives are memory copies between threads, so the throughput shows the cost
of the extra program structure, not of an interconnect. On a GPU/TPU host run the same
command; every device the process sees is used.
"""

from __future__ import annotations

import shutil
import statistics
import sys
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
from estimator.driver import progress
from estimator.engine.loops import TrainState
from estimator.parallel import zero

LAYOUTS = {
    "replicated": {},
    "shard_optimizer_state": {"shard_optimizer_state": True},
    "shard_params": {"shard_params": True},
}
IPL = 100
FEATURES, CLASSES = 1024, 10
WIDTHS = (1, 2, 4)
#: Hidden layers of the deep variant (compiled only): many equal layers, where gathering each
#: parameter at its use holds one layer at a time instead of the whole model.
DEEP = 8


def sizes(quick: bool, width: int = 1, layers: int = 2) -> dict:
    """The workload; ``width`` multiplies the input and hidden widths; ``layers`` hidden
    layers of ``hidden`` units."""
    if quick:
        return {
            "layers": layers,
            "features": 64 * width,
            "hidden": 256 * width,
            "batch": 64,
            "ipl": 2,
            "batches": 8,
            "steps": 4,
        }
    return {
        "layers": layers,
        "features": FEATURES * width,
        "hidden": 2048 * width,
        "batch": 128,
        "ipl": IPL,
        "batches": 20,
        "steps": 2 * IPL,
    }


def _model_fn(features, labels, mode, params):
    h = features
    for _ in range(params["layers"]):
        h = nn.relu(nn.Dense(params["hidden"])(h))
    logits = nn.Dense(CLASSES)(h)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.adam(1e-3))


def _data(size: dict) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(0)
    x = rng.randn(size["batches"], size["batch"], size["features"]).astype(np.float32)
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
        _model_fn,
        config=config,
        params={"hidden": size["hidden"], "layers": size["layers"]},
        train_batch_size=size["batch"],
    )


def state_bytes(est: estimator.TPUEstimator) -> tuple[int, int]:
    """Bytes one device holds of (params, optimizer state) of the estimator's live state."""
    state = est._job.store.last.state
    return zero.bytes_per_device(state.params), zero.bytes_per_device(state.opt_state)


def abstract_state(est: estimator.TPUEstimator, layout: str, size: dict) -> TrainState:
    """The MLP's TrainState as ``ShapeDtypeStruct``s laid out as ``layout`` keeps it."""
    f, w, n = size["features"], size["hidden"], size["layers"]
    shapes = {"Dense_0": (f, w), **{f"Dense_{i}": (w, w) for i in range(1, n)}}
    shapes[f"Dense_{n}"] = (w, CLASSES)
    params = {
        k: {
            "kernel": jax.ShapeDtypeStruct(s, jnp.float32),
            "bias": jax.ShapeDtypeStruct(s[1:], jnp.float32),
        }
        for k, s in shapes.items()
    }
    tx = optax.adam(1e-3)
    opt = jax.eval_shape(tx.init, params)
    mesh = est.mesh
    if layout == "replicated":
        p_sh, o_sh = zero.named(mesh, jax.tree.map(lambda _: P(), params)), None
    else:
        p_sh, o_sh = zero.state_shardings(
            mesh, tx, params, opt, None, shard_params=layout == "shard_params"
        )
    rep = NamedSharding(mesh, P())
    o_sh = o_sh if o_sh is not None else jax.tree.map(lambda _: rep, opt)

    def put(tree, shardings):
        return jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings
        )

    def scalar(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    return TrainState(
        put(params, p_sh),
        {},
        put(opt, o_sh),
        scalar((), jnp.int32),
        scalar((2,), jnp.uint32),
        scalar((), jnp.int32),
    )


def program_memory(est: estimator.TPUEstimator, layout: str, size: dict) -> dict:
    """Per-device bytes of the compiled train loop (XLA ``memory_analysis``), compiled for
    abstract state (nothing is allocated, so large widths can be measured too)."""
    state = abstract_state(est, layout, size)
    loop = est._job.programs.train_for(state, size["batch"] // est.num_replicas)
    sharding = NamedSharding(est.mesh, P(None, "data"))
    xs = jax.ShapeDtypeStruct(
        (size["ipl"], size["batch"], size["features"]), jnp.float32, sharding=sharding
    )
    ys = jax.ShapeDtypeStruct((size["ipl"], size["batch"]), jnp.int32, sharding=sharding)
    compiled = loop.lower(state, xs, ys).compile()
    return progress.program_memory(compiled) or {}


#: The fresh-process probes train 2 loops at this iterations_per_loop (40 steps): the peak
#: does not depend on the step count, and the probe of 200 steps took over 10 minutes on a
#: loaded 2-core machine.
PROBE_IPL = 20


def probe(layout: str, quick: bool) -> None:
    size = sizes(quick)
    if not quick:
        size = {**size, "ipl": PROBE_IPL}
    x, y = _data(size)
    mem = C.MemoryProbe()
    mem.start()
    tmp = tempfile.mkdtemp(prefix="bench_probe_")
    try:
        make_estimator(layout, tmp, size).train(_input_fn(x, y), steps=2 * size["ipl"])
        C.print_probe_result(mem.result())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _mib(n: float | None) -> float | None:
    return None if n is None else n / 2**20


def _widths(quick: bool, width: int) -> str:
    size = sizes(quick, width)
    return f"{size['features']}-{size['hidden']}"


def width_peaks(size_of: Callable[[int], dict], tmp: str, widths) -> dict[str, list]:
    """``{layout: [loop peak MiB/device at each width]}``."""
    out = {}
    for k in LAYOUTS:
        out[k] = []
        for width in widths:
            size = size_of(width)
            est = make_estimator(k, f"{tmp}/{k}_w{width}", size)
            out[k].append(_mib(program_memory(est, k, size).get("peak")))
    return out


def main(argv=None) -> str | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    memory_only = "--memory-only" in argv
    argv = [a for a in argv if a != "--memory-only"]
    started = C.start(__doc__, argv, probe, default_repeats=3)
    if started is None:
        return None
    args, repeats = started
    size = sizes(args.quick)
    x, y = _data(size)
    input_fn = _input_fn(x, y)
    tmp = tempfile.mkdtemp(prefix="bench_sharded_")
    times: dict = {}
    try:
        ests = {k: make_estimator(k, f"{tmp}/{k}", size) for k in LAYOUTS}
        if not memory_only:
            for est in ests.values():
                C.warm_up(est, input_fn, size["ipl"])
            times = C.interleave(
                {
                    k: (lambda e=e: C.timed_train(e, input_fn, size["steps"]))
                    for k, e in ests.items()
                },
                repeats=repeats,
            )
        program = {k: program_memory(e, k, size) for k, e in ests.items()}
        # compiles only; the smoke run (--quick) leaves the larger widths out
        widths = () if args.quick else WIDTHS[1:]
        by_width = width_peaks(lambda w: sizes(args.quick, w), tmp, widths)
        deep = width_peaks(lambda w: sizes(args.quick, w, DEEP), tmp, () if args.quick else (1,))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # --quick (the smoke test) skips the fresh-process probes: three more processes
    skip = args.no_memory or args.quick
    peaks = C.probe_all("benchmarks.sharded_state", list(LAYOUTS), quick=args.quick, skip=skip)
    rows = []
    base = [t.per_step for t in times.get("replicated", [])]
    for k in LAYOUTS:
        per_step = [t.per_step for t in times.get(k, [])]
        held = state_bytes(ests[k]) if per_step else (None, None)
        m = program[k]
        rows.append(
            [
                k,
                size["batch"] / statistics.median(per_step) if per_step else None,
                C.median_ratio(base, per_step) if per_step else None,
                _mib(held[0]),
                _mib(held[1]),
                _mib(m.get("arguments")),
                _mib(m.get("temporaries")),
                _mib(m.get("peak")),
                _mib(m["peak"] * len(jax.devices())) if m else None,
                *(by_width[k] or [None] * (len(WIDTHS) - 1)),
                (deep[k] or [None])[0],
                peaks.get(k),
            ]
        )
    columns = [
        "layout",
        "examples/s",
        "vs replicated",
        "params MiB/device",
        "opt state MiB/device",
        "loop arguments MiB/device",
        "loop temporaries MiB/device",
        "loop peak MiB/device",
        f"loop peak x {len(jax.devices())} devices MiB",
        *(f"loop peak MiB/device, {w}x widths" for w in WIDTHS[1:]),
        f"loop peak MiB/device, {DEEP} hidden layers",
        "peak MiB (probe)",
    ]
    f, w = size["features"], size["hidden"]
    params = f * w + w + w * w + w + w * CLASSES + CLASSES
    notes = [
        f"MLP {f}-{w}-{w}-{CLASSES} ({params:,} parameters), Adam, global batch "
        f"{size['batch']}, iterations_per_loop {size['ipl']}, {size['steps']} steps per timed "
        f"call, {repeats} interleaved repeats{' (not run: --memory-only)' if memory_only else ''}.",
        "Loop figures: XLA memory_analysis() of the compiled train loop, for one device "
        "(arguments include the loop's stacked input batches). On CPU the devices are "
        "simulated in one process: collectives are copies between threads, and the probe's "
        "peak is the whole process's host RSS growth (compare it with the x devices column).",
    ]
    notes.append(
        "Widths (input-hidden): "
        + ", ".join(f"{w}x {_widths(args.quick, w)}" for w in WIDTHS)
        + f"; {DEEP} hidden layers: {_widths(args.quick, 1)} with {DEEP} equal hidden layers "
        f"(input, {DEEP - 1} hidden-to-hidden kernels, output). The larger widths and the deep "
        "variant are compiled for abstract state, nothing allocated."
    )
    return C.report("Sharded training state", columns, rows, notes)


if __name__ == "__main__":
    main()
