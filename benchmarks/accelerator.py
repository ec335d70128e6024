"""Accelerator numbers in one command: training and evaluation against hand-written loops.

Run from the repository root on the accelerator host (about 8 minutes on one GPU)::

    python -m benchmarks.accelerator [--json accelerator.json] [--repeats N] [--no-memory]
    python -m benchmarks.accelerator --quick        # a tiny smoke run, on CPU too

Every case runs in this one process, on every device it sees, after a warm-up (so nothing
timed compiles), interleaved with its baseline over ``--repeats`` repeats (medians of the
per-repeat ratios):

* **ResNet-50 training** (``models/resnet.py``, bfloat16 compute, float32 parameters, batch
  256 of 224x224x3 uint8 images, SGD with Nesterov momentum, ``iterations_per_loop`` 100):
  the estimator against a hand-written ``jit(shard_map(scan(step)))`` of the same module,
  loss and optimizer on data already on the devices. The issue's target is >= 0.95x.
  bfloat16 comes from ``TPUConfig(compute_dtype="bfloat16")`` where ``TPUConfig`` has that
  field, otherwise from the model's own ``dtype`` parameter; the table says which.
* **Transformer LM training** (``models/transformer.py``: 8 layers, d_model 512, sequence
  256, batch 64, AdamW with global-norm clipping): the same comparison.
* **host_call every step**: the LM with its summaries host_call running every step
  (``host_call_every_n_steps=1``, TensorBoard events written), against the estimator without.
* **Evaluation**: the LM's ``evaluate`` (loss, perplexity and accuracy metrics) against a
  hand-written ``jit(shard_map(scan(forward)))`` computing the same loss and accuracy sums.
* **Peak device memory of the LM train loop** per layout (replicated, ZeRO-1
  ``shard_optimizer_state``, FSDP ``shard_params``): XLA's ``memory_analysis()`` of the
  compiled loop (one device), and unless ``--no-memory`` or ``--quick``, each layout trained
  in a fresh process that reports device 0's ``peak_bytes_in_use`` (host RSS growth on CPU).
  With one device the three layouts are the same program: splitting needs replicas.

Beside each training row: TFLOP/s per device and MFU, from the model FLOPs of one global step
(XLA's cost analysis of the hand-written loop, the figure the estimator itself reports as
``perf/model_flops_per_step``) and the device's peak (``driver/throughput.PEAK_TFLOPS``; no
MFU where the peak is unknown, as on CPU).

Every estimator and hand-written loop of the run compiles through one private persistent
compilation cache (a temporary directory, removed at the end), so a program that several
estimators run (the LM's init, its train loop) compiles once; nothing timed compiles either
way.

Prints one table (markdown) and writes it as JSON (``--json``, default ``accelerator.json``;
with ``--quick``, ``accelerator.json`` in the temporary directory).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import estimator
from benchmarks import _common as C
from benchmarks import _workloads as W
from estimator.core import compilation
from estimator.driver import progress, throughput
from models import mlp, resnet, transformer

LAYOUTS = {
    "replicated": {},
    "shard_optimizer_state": {"shard_optimizer_state": True},
    "shard_params": {"shard_params": True},
}
DATA = W.DATA


_RUN_CACHE: list = [None]  # this run's private compilation cache directory (main sets it)


def sizes(quick: bool) -> dict:
    """ResNet and LM workloads; ``quick``: tiny ones for a CPU smoke run."""
    if quick:
        return {
            "resnet": {
                "depth": 50,
                "stage_sizes": (1, 1, 1, 1),
                "num_filters": 8,
                "stem": "cifar",
                "image": 8,
                "num_classes": 10,
                "batch": 8,
                "ipl": 1,
            },
            "lm": {
                "num_layers": 1,
                "d_model": 32,
                "num_heads": 2,
                "max_len": 16,
                "batch": 16,
                "ipl": 2,
            },
            "calls": 1,
        }
    return {
        "resnet": {
            "depth": 50,
            "stage_sizes": None,
            "num_filters": 64,
            "stem": "imagenet",
            "image": 224,
            "num_classes": 1000,
            "batch": 256,
            "ipl": 100,
        },
        "lm": {
            "num_layers": 8,
            "d_model": 512,
            "num_heads": 8,
            "max_len": 256,
            "batch": 64,
            "ipl": 100,
        },
        "calls": 2,
    }


def has_compute_dtype() -> bool:
    """Whether ``TPUConfig`` has a ``compute_dtype`` field (mixed precision in the loop)."""
    return "compute_dtype" in {f.name for f in dataclasses.fields(estimator.TPUConfig)}


# ----------------------------------------------------------------------------- workloads
def resnet_params(s: dict) -> dict:
    params = {k: s[k] for k in ("depth", "stage_sizes", "num_filters", "stem", "num_classes")}
    return {
        **params,
        "learning_rate": 0.1,
        "optimizer": "momentum",
        "write_summaries": False,
        "dtype": "float32" if has_compute_dtype() else "bfloat16",
    }


def lm_params(s: dict, *, host_call: bool = False) -> dict:
    return {
        "num_layers": s["num_layers"],
        "d_model": s["d_model"],
        "num_heads": s["num_heads"],
        "max_len": s["max_len"],
        "learning_rate": 1e-3,
        "warmup_steps": 10,
        "write_summaries": host_call,
    }


def resnet_data(s: dict, batches: int = 2) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(0)
    x = rng.randint(0, 256, (batches, s["batch"], s["image"], s["image"], 3)).astype(np.uint8)
    return x, rng.randint(0, s["num_classes"], (batches, s["batch"])).astype(np.int32)


def lm_data(s: dict, batches: int = 2) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(0)
    t = rng.randint(0, transformer.VOCAB_SIZE, (batches, s["batch"], s["max_len"] + 1))
    t = t.astype(np.int32)
    return t[..., :-1], t[..., 1:]


def make_estimator(
    model_fn, params: dict, s: dict, model_dir: str, **tpu
) -> estimator.TPUEstimator:
    if has_compute_dtype() and model_fn is resnet.model_fn:
        tpu = {"compute_dtype": "bfloat16", **tpu}
    config = estimator.RunConfig(
        model_dir=model_dir,
        tpu_config=estimator.TPUConfig(iterations_per_loop=s["ipl"], **tpu),
        progress_bar=False,
        compilation_cache_dir=_RUN_CACHE[0] or False,
        resume_input_position=False,
        save_summary_steps=0,
        log_step_count_steps=0,
    )
    return estimator.TPUEstimator(
        model_fn,
        config=config,
        params=params,
        train_batch_size=s["batch"],
        eval_batch_size=s["batch"],
    )


# ----------------------------------------------------------------------------- hand-written
def _module(kind: str, s: dict):
    if kind == "resnet":
        return resnet.resnet(
            s["depth"],
            stage_sizes=s["stage_sizes"],
            num_classes=s["num_classes"],
            num_filters=s["num_filters"],
            stem=s["stem"],
            dtype=jnp.bfloat16,
        )
    return transformer._module(lm_params(s))


def _optimizer(kind: str, s: dict) -> optax.GradientTransformation:
    if kind == "resnet":
        return mlp.make_optimizer(resnet_params(s))[0]
    tx, _ = mlp.make_optimizer(lm_params(s))
    return optax.chain(optax.clip_by_global_norm(1.0), tx)


def hand_written_train(kind: str, s: dict, mesh, x0: np.ndarray) -> tuple[Callable, tuple]:
    """``jit(shard_map(scan(step)))`` with the docs/strategy.md gradient pattern; state."""
    module, tx = _module(kind, s), _optimizer(kind, s)
    train_kw = {"train": True}
    variables = jax.jit(lambda x: module.init(jax.random.key(0), x, **train_kw))(x0[:1])
    params, stats = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    state = jax.device_put((params, stats, tx.init(params)), NamedSharding(mesh, P()))

    def step(carry, batch):
        params, stats, opt = carry
        x, y = batch

        def loss_fn(p):
            out, new = module.apply({"params": p, **stats}, x, **train_kw, mutable=list(stats))
            loss = optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
            return loss, new

        pv = jax.tree.map(lambda a: lax.pcast(a, DATA, to="varying"), params)
        (loss, new), g = jax.value_and_grad(loss_fn, has_aux=True)(pv)
        g = jax.tree.map(lambda a: lax.pmean(a.astype(jnp.float32), DATA).astype(a.dtype), g)
        new = jax.tree.map(lambda a: lax.pmean(a, DATA), dict(new))
        updates, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, updates), new, opt), lax.pmean(loss, DATA)

    unroll = jax.default_backend() == "cpu"  # XLA:CPU's rolled conv gradients (jax#12868)

    def loop(state, xs, ys):
        return lax.scan(step, state, (xs, ys), unroll=0 if unroll else 1)

    sharded = jax.shard_map(
        loop, mesh=mesh, in_specs=(P(), P(None, DATA), P(None, DATA)), out_specs=(P(), P())
    )
    return jax.jit(sharded, donate_argnums=0), state


def step_flops(loop: Callable, state: tuple, chunk: tuple, ipl: int) -> float | None:
    """Model FLOPs of one global step: XLA's cost analysis of the hand-written loop (one
    device's, a rolled loop counted once), as the estimator reads its own (``perf/``)."""
    compiled = loop.lower(state, *chunk).compile()
    flops = throughput.loop_flops(compiled)
    if flops is None:
        return None
    unrolled = jax.default_backend() == "cpu"  # hand_written_train unrolls there
    return flops * len(jax.devices()) / (ipl if unrolled else 1)


def utilisation(flops: float | None, steps_per_s: float) -> dict:
    """TFLOP/s per device and, where the device's peak is known, MFU."""
    if flops is None:
        return {}
    per_device = flops * steps_per_s / len(jax.devices())
    peak = throughput.peak_flops(jax.devices()[0].device_kind)
    return {"tflops_per_device": per_device / 1e12, "mfu": per_device / peak if peak else None}


def hand_written_eval(s: dict, mesh, params) -> Callable:
    """The LM's forward over ``[n, GB, T]`` chunks: per-replica loss and correct-token sums."""
    module = _module("lm", s)

    def step(p, batch):
        x, y = batch
        logits = module.apply({"params": p}, x, train=False)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()[None]
        return p, (loss, (logits.argmax(-1) == y).sum()[None])

    sharded = jax.shard_map(
        lambda p, xs, ys: lax.scan(step, p, (xs, ys))[1],
        mesh=mesh,
        in_specs=(P(), P(None, DATA), P(None, DATA)),
        out_specs=P(None, DATA),
    )
    return jax.jit(sharded)


def staged(x: np.ndarray, y: np.ndarray, ipl: int, mesh) -> tuple[jax.Array, jax.Array]:
    """One ``[ipl, GB, ...]`` chunk on the devices, cycling the host batches."""
    idx = np.arange(ipl) % len(x)
    return jax.block_until_ready(
        jax.device_put((x[idx], y[idx]), NamedSharding(mesh, P(None, DATA)))
    )


# ----------------------------------------------------------------------------- cases
def _cycle(x: np.ndarray, y: np.ndarray) -> Callable:
    def input_fn(params):
        while True:
            for b in range(len(x)):
                yield x[b], y[b]

    return input_fn


def _finite_eval(x: np.ndarray, y: np.ndarray) -> Callable:
    def input_fn(params):
        for b in range(len(x)):
            yield x[b], y[b]

    return input_fn


def hand_written_case(loop: Callable, state: tuple, chunk: tuple, calls: int):
    """A timer for ``calls`` back-to-back calls of the hand-written loop (seconds per call)."""
    holder = {"state": state}

    def run() -> float:
        def go():
            for _ in range(calls):
                holder["state"], losses = loop(holder["state"], *chunk)
            jax.block_until_ready(losses)

        return C.timed(go) / calls

    run()  # compile and warm up
    run()
    return run


def estimator_case(est, input_fn: Callable, s: dict, calls: int):
    """A timer for ``est.train`` of ``calls`` loops: steady seconds per loop of ``ipl`` steps."""
    C.warm_up(est, input_fn, s["ipl"])

    def run() -> float:
        return C.timed_train(est, input_fn, (calls + 1) * s["ipl"]).per_step * s["ipl"]

    return run


def train_rows(kind: str, s: dict, calls: int, repeats: int, tmp: str) -> list[dict]:
    """ResNet or LM: the hand-written loop, the estimator (and for the LM with host_call)."""
    mesh = W.make_mesh()
    x, y = resnet_data(s) if kind == "resnet" else lm_data(s)
    loop, state = hand_written_train(kind, s, mesh, x[0])
    chunk = staged(x, y, s["ipl"], mesh)
    flops = step_flops(loop, state, chunk, s["ipl"])
    cases = {"hand-written jit(scan)": hand_written_case(loop, state, chunk, calls)}
    if kind == "resnet":
        est = make_estimator(resnet.model_fn, resnet_params(s), s, f"{tmp}/resnet")
        cases["estimator"] = estimator_case(est, _cycle(x, y), s, calls)
    else:
        est = make_estimator(transformer.model_fn, lm_params(s), s, f"{tmp}/lm")
        cases["estimator"] = estimator_case(est, _cycle(x, y), s, calls)
        hc = make_estimator(
            transformer.model_fn,
            lm_params(s, host_call=True),
            s,
            f"{tmp}/lm_hc",
            host_call_every_n_steps=1,
        )
        cases["estimator, host_call every step"] = estimator_case(hc, _cycle(x, y), s, calls)
    times = C.interleave(cases, repeats=repeats)
    base = times["hand-written jit(scan)"]
    rows = []
    for name, t in times.items():
        steps_per_s = s["ipl"] / statistics.median(t)
        rows.append(
            {
                "workload": "ResNet-50 train" if kind == "resnet" else "Transformer LM train",
                "case": name,
                "examples_per_s": s["batch"] * steps_per_s,
                "vs_hand_written": C.median_ratio(base, t),
                **utilisation(flops, steps_per_s),
            }
        )
    if kind == "lm":
        no_hc = times["estimator"]
        rows[-1]["vs_estimator_without_host_call"] = C.median_ratio(
            no_hc, times["estimator, host_call every step"]
        )
    return rows


def eval_rows(s: dict, calls: int, repeats: int, tmp: str) -> list[dict]:
    """The LM's evaluate against the hand-written forward loop, on ``ipl`` batches each."""
    mesh = W.make_mesh()
    x, y = lm_data(s, batches=s["ipl"])
    est = make_estimator(transformer.model_fn, lm_params(s), s, f"{tmp}/lm_eval")
    est.train(_cycle(x, y), steps=1)
    params = est._job.store.last.state.params["TransformerLM_0"]  # model_fn's module
    params = jax.device_put(jax.device_get(params), NamedSharding(mesh, P()))
    loop = hand_written_eval(s, mesh, params)
    chunk = staged(x, y, s["ipl"], mesh)

    def hand() -> float:
        return (
            C.timed(lambda: [jax.block_until_ready(loop(params, *chunk)) for _ in range(calls)])
            / calls
        )

    def est_case() -> float:
        return (
            C.timed(
                lambda: [est.evaluate(_finite_eval(x, y), steps=s["ipl"]) for _ in range(calls)]
            )
            / calls
        )

    hand(), est_case()  # compile and warm up
    times = C.interleave({"hand-written jit(scan)": hand, "estimator": est_case}, repeats=repeats)
    base = times["hand-written jit(scan)"]
    return [
        {
            "workload": "Transformer LM eval",
            "case": k,
            "examples_per_s": s["batch"] * s["ipl"] / statistics.median(t),
            "vs_hand_written": C.median_ratio(base, t),
        }
        for k, t in times.items()
    ]


def lm_loop_memory(layout: str, s: dict, tmp: str) -> dict:
    """The LM train loop's per-device bytes in ``layout`` (XLA memory_analysis)."""
    x, y = lm_data(s)
    est = make_estimator(
        transformer.model_fn, lm_params(s), s, f"{tmp}/mem_{layout}", **LAYOUTS[layout]
    )
    est.train(_cycle(x, y), steps=s["ipl"])
    state = est._job.store.last.state
    sharding = NamedSharding(est.mesh, P(None, DATA))
    xs = jax.ShapeDtypeStruct((s["ipl"], *x.shape[1:]), x.dtype, sharding=sharding)
    ys = jax.ShapeDtypeStruct((s["ipl"], *y.shape[1:]), y.dtype, sharding=sharding)
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )
    loop = est._job.programs.train_for(abstract, s["batch"] // est.num_replicas)
    return progress.program_memory(loop.lower(abstract, xs, ys).compile()) or {}


def probe(layout: str, quick: bool) -> None:
    """A fresh process: the LM trained in ``layout``; its peak (device, or host RSS)."""
    s = sizes(quick)["lm"]
    x, y = lm_data(s)
    mem = C.MemoryProbe()
    mem.start()
    tmp = tempfile.mkdtemp(prefix="bench_accel_probe_")
    try:
        est = make_estimator(transformer.model_fn, lm_params(s), s, tmp, **LAYOUTS[layout])
        est.train(_cycle(x, y), steps=2 * s["ipl"])
        C.print_probe_result(mem.result())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def memory_rows(s: dict, quick: bool, skip_probes: bool, tmp: str) -> list[dict]:
    peaks = C.probe_all("benchmarks.accelerator", list(LAYOUTS), quick=quick, skip=skip_probes)
    rows = []
    for layout in LAYOUTS:
        m = lm_loop_memory(layout, s, tmp)
        rows.append(
            {
                "workload": "Transformer LM memory",
                "case": layout,
                "loop_peak_mib_per_device": m["peak"] / 2**20 if m else None,
                "loop_temporaries_mib_per_device": m["temporaries"] / 2**20 if m else None,
                "peak_mib_probe": peaks.get(layout),
            }
        )
    return rows


# ----------------------------------------------------------------------------- main
COLUMNS = [
    ("workload", "workload"),
    ("case", "case"),
    ("examples_per_s", "examples/s"),
    ("vs_hand_written", "vs hand-written"),
    ("tflops_per_device", "TFLOP/s/device"),
    ("mfu", "MFU"),
    ("vs_estimator_without_host_call", "vs without host_call"),
    ("loop_peak_mib_per_device", "loop peak MiB/device"),
    ("loop_temporaries_mib_per_device", "loop temporaries MiB/device"),
    ("peak_mib_probe", "peak MiB (probe)"),
]


def main(argv=None) -> str | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    quick = "--quick" in argv  # a smoke run writes its JSON out of the way
    out = os.path.join(tempfile.gettempdir(), "accelerator.json") if quick else "accelerator.json"
    if "--json" in argv:
        i = argv.index("--json")
        out = argv[i + 1]
        del argv[i : i + 2]
    started = C.start(__doc__, argv, probe, default_repeats=2)
    if started is None:
        return None
    args, repeats = started
    size = sizes(args.quick)
    tmp = tempfile.mkdtemp(prefix="bench_accel_")
    before = jax.config.jax_compilation_cache_dir
    _RUN_CACHE[0] = compilation.configure_cache(os.path.join(tmp, "jax_cache"))
    try:
        rows = train_rows("resnet", size["resnet"], size["calls"], repeats, tmp)
        rows += train_rows("lm", size["lm"], size["calls"], repeats, tmp)
        rows += eval_rows(size["lm"], size["calls"], repeats, tmp)
        rows += memory_rows(size["lm"], args.quick, args.no_memory or args.quick, tmp)
    finally:
        _RUN_CACHE[0] = None
        compilation.configure_cache(before or False)
        shutil.rmtree(tmp, ignore_errors=True)
    bf16 = "TPUConfig(compute_dtype='bfloat16')" if has_compute_dtype() else "the model's dtype"
    notes = [
        f"ResNet-50 in bfloat16 via {bf16}; batch {size['resnet']['batch']}, images "
        f"{size['resnet']['image']}x{size['resnet']['image']}, iterations_per_loop "
        f"{size['resnet']['ipl']}; LM {size['lm']['num_layers']} layers, d_model "
        f"{size['lm']['d_model']}, sequence {size['lm']['max_len']}, batch {size['lm']['batch']}; "
        f"{repeats} interleaved repeats of {size['calls']} loops each.",
        "Loop figures: XLA memory_analysis() of the compiled train loop, one device.",
        "TFLOP/s and MFU: model FLOPs of one global step from XLA's cost analysis of the "
        f"hand-written loop; peak of {jax.devices()[0].device_kind!r}: "
        f"{throughput.peak_flops(jax.devices()[0].device_kind) or 'unknown'} FLOP/s.",
    ]
    text = C.report(
        "Accelerator: training, evaluation, host_call, memory",
        [c for _, c in COLUMNS],
        [[r.get(k) for k, _ in COLUMNS] for r in rows],
        notes,
    )
    with open(out, "w") as f:
        json.dump(
            {"machine": C.machine(), "quick": args.quick, "rows": rows, "notes": notes}, f, indent=1
        )
    print(f"JSON: {out}")
    return text


if __name__ == "__main__":
    main()
