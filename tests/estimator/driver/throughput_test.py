"""Model FLOPs, FLOP/s and MFU per device from the compiled train loop: what XLA's cost
analysis reports, the analytic cross-checks (MLP, the zoo's Transformer LM), the log lines
and TensorBoard scalars, and that reading them compiles nothing."""

from __future__ import annotations

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import estimator
import estimator.core.compilation
from estimator.driver import throughput
from hooks import SessionRunContext, SessionRunValues
from models import transformer
from tests import helpers as h
from tests.estimator.driver import tb_reader

BATCH = 256  # global: 32 rows per replica on the 8 test devices


class _MLP(nn.Module):
    """The benchmarks' MLP, 64-512-512-10."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(512)(x))
        x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(10)(x)


def _mlp_model_fn(features, labels, mode, params):
    logits = _MLP()(features)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.adam(1e-3))


def _mlp_input_fn(params):
    rng = np.random.RandomState(0)
    x = rng.randn(BATCH, 64).astype(np.float32)
    y = rng.randint(0, 10, BATCH).astype(np.int32)
    while True:
        yield x, y


MLP_PARAMS = 64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10


def _train_and_read(tmp_path, model_fn, input_fn, batch, *, params=None, steps=6, **cfg):
    est = h.make_estimator(
        tmp_path, model_fn, batch=batch, ipl=2, params=params, save_summary_steps=2, **cfg
    )
    est.train(input_fn, max_steps=steps)
    mux = tb_reader.multiplexer(tmp_path)
    return {
        tag: tb_reader.scalars(mux, ".", tag)
        for tag in throughput.TAGS[:2] + ("perf/model_flops_per_step",)
    }


# ------------------------------------------------------------------ XLA's cost analysis
def _sgd_loop(unroll):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

    def step(w, xy):
        x, y = xy
        wv = lax.pcast(w, "data", to="varying")
        g = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(wv)
        return w - 0.1 * lax.pmean(g, "data"), None

    def loop(w, xs, ys):
        return lax.scan(step, w, (xs, ys), unroll=unroll)[0]

    specs = dict(in_specs=(P(), P(None, "data"), P(None, "data")), out_specs=P())
    return jax.jit(jax.shard_map(loop, mesh=mesh, **specs))


@pytest.mark.parametrize("steps, unroll, counted", [(1, 1, 1), (10, 1, 1), (10, 0, 10)])
def test_cost_analysis_counts_one_device_and_a_rolled_loop_once(steps, unroll, counted):
    # What ModelFlops relies on: one device's flops; a rolled loop's body once, an unrolled
    # loop's every step. 64x32 matmul, rows 256 over 8 devices: forward 2*32*64*32 per device.
    xs = jax.ShapeDtypeStruct((steps, BATCH, 64), jnp.float32)
    ys = jax.ShapeDtypeStruct((steps, BATCH, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    compiled = _sgd_loop(unroll).lower(w, xs, ys).compile()
    one_step_one_device = 3 * 2 * (BATCH // 8) * 64 * 32  # forward, and grad of w (2 matmuls)
    ratio = throughput.loop_flops(compiled) / (counted * one_step_one_device)
    assert 0.66 <= ratio <= 1.1  # matmuls, plus the loss's and the update's elementwise ops
    assert throughput.inner_loops(compiled, unrolled=unroll == 0) == 0


@pytest.mark.parametrize(
    "kind, tflops",
    [
        ("TPU v4", 275),
        ("TPU v5 lite", 197),
        ("TPU v5p", 459),
        ("TPU v5", 459),
        ("TPU v6 lite", 918),
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H200", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("cpu", None),
        ("Some future chip", None),
    ],
)
def test_peak_of_each_known_device_kind(kind, tflops):
    assert throughput.peak_flops(kind) == (None if tflops is None else tflops * 1e12)


# ------------------------------------------------------------------ the figures
class _Compiled:
    def __init__(self, flops):
        self._flops = flops

    def cost_analysis(self):
        return {"flops": self._flops}

    def as_text(self):
        return "ENTRY main { w = while(x) }"


def test_figures_per_device_and_mfu_with_a_known_peak():
    flops = throughput.ModelFlops(
        lambda: _Compiled(1e12), steps=10, unrolled=False, devices=4, device_kind="TPU v4"
    )
    got = flops.figures(steps_per_sec=2.0, examples_per_step=128)
    assert flops.per_step == 4e12  # one device's 1e12, a rolled loop: one step, 4 devices
    assert got["perf/examples_per_sec_per_device"] == 64.0
    assert got["perf/tflops_per_device"] == pytest.approx(2.0)
    assert got["perf/mfu"] == pytest.approx(2.0 / 275)
    assert got["perf/model_flops_per_step"] == 4e12


def test_an_unrolled_loop_is_divided_by_its_steps_and_cpu_has_no_mfu():
    flops = throughput.ModelFlops(
        lambda: _Compiled(1e10), steps=10, unrolled=True, devices=8, device_kind="cpu"
    )
    got = flops.figures(steps_per_sec=1.0, examples_per_step=8)
    assert flops.per_step == 8e9
    assert "perf/mfu" not in got
    assert "no known peak for cpu" in flops.line(steps_per_sec=1.0, examples_per_step=8)


def test_no_analysis_gives_examples_per_second_only():
    flops = throughput.ModelFlops(None, steps=1, unrolled=False, devices=2, device_kind="cpu")
    assert flops.figures(steps_per_sec=3.0, examples_per_step=4) == {
        "perf/examples_per_sec_per_device": 6.0
    }


class _Writer:
    def __init__(self):
        self.events = []

    def add_scalar(self, tag, value, global_step):
        self.events.append((tag, global_step, value))


def test_summary_hook_writes_at_the_cadence_after_the_first_loop_and_at_the_end():
    now = [0.0]
    writer = _Writer()
    flops = throughput.ModelFlops(
        lambda: _Compiled(1e9), steps=5, unrolled=False, devices=2, device_kind="TPU v4"
    )
    hook = throughput.PerfSummaryHook(
        writer, every=10, flops=flops, examples_per_step=16, clock=lambda: now[0]
    )
    for loop in range(5):  # loops of 5 steps, 1 s each (the first one compiles)
        now[0] += 1.0
        steps = np.arange(5 * loop + 1, 5 * loop + 6)
        hook.after_run(SessionRunContext(None, None, steps=steps), SessionRunValues(None))
    hook.end(None)
    mfu = [(s, v) for t, s, v in writer.events if t == "perf/mfu"]
    # written at 10 (steps 6-10 in 1 s), 20 (11-20 in 2 s) and at the end, 25 (6-25 in 4 s)
    assert [s for s, _ in mfu] == [10, 20, 25]
    per_step_tflops = 2e9 / 2 / 1e12
    assert [v for _, v in mfu] == pytest.approx([5 * per_step_tflops / 275] * 3)


def test_the_progress_line_is_followed_by_the_per_device_figures(caplog):
    flops = throughput.ModelFlops(
        lambda: _Compiled(1e12), steps=1, unrolled=False, devices=8, device_kind="NVIDIA H200"
    )
    hook = throughput.PerfStepCounterHook(every_n_steps=1, flops=flops)
    with caplog.at_level(logging.INFO, logger="estimator"):
        hook._report(10, 2.0, 256)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:2] == ["global_step/sec: 2", "examples/sec: 512"]
    assert lines[2] == (
        "per device: 64 examples/sec, 2 TFLOP/s, MFU 0.2% of 989 TFLOP/s bf16; "
        "model FLOPs per step 8e+12 (XLA cost analysis)"
    )


# ------------------------------------------------------------------ end to end
def test_mlp_model_flops_match_six_n_t_and_a_hand_written_loops_cost_analysis(tmp_path):
    got = _train_and_read(tmp_path, _mlp_model_fn, _mlp_input_fn, BATCH)
    (flops,) = set(got["perf/model_flops_per_step"].values())
    analytic = 6 * MLP_PARAMS * BATCH  # forward and backward of every weight, per example
    assert flops == pytest.approx(analytic, rel=0.10)
    # The same step written by hand (data-parallel adam, as the benchmarks' ceiling).
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    params = _MLP().init(jax.random.key(0), jnp.zeros((1, 64)))
    tx = optax.adam(1e-3)

    def step(state, xy):
        p, opt = state
        x, y = xy
        pv = jax.tree.map(lambda a: lax.pcast(a, "data", to="varying"), p)

        def loss(p):
            logits = _MLP().apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        g = lax.pmean(jax.grad(loss)(pv), "data")
        updates, opt = tx.update(g, opt, p)
        return (optax.apply_updates(p, updates), opt), None

    def loop(state, xs, ys):
        return lax.scan(step, state, (xs, ys))[0]

    specs = dict(in_specs=(P(), P(None, "data"), P(None, "data")), out_specs=P())
    state = (params, tx.init(params))
    xs = jax.ShapeDtypeStruct((2, BATCH, 64), jnp.float32)
    ys = jax.ShapeDtypeStruct((2, BATCH), jnp.int32)
    compiled = jax.jit(jax.shard_map(loop, mesh=mesh, **specs)).lower(state, xs, ys).compile()
    # The estimator's step also checks the new state all-finite (a pass over the params and
    # both Adam moments, 2% of this step): the rest is the same program.
    assert flops == pytest.approx(throughput.loop_flops(compiled) * 8, rel=0.03)
    # XLA counts an unrolled loop step by step: divided by its steps, the same count.
    unrolled = _train_and_read(
        tmp_path / "unrolled", _mlp_model_fn, _mlp_input_fn, BATCH, tpu={"unroll_loops": True}
    )
    (unrolled_flops,) = set(unrolled["perf/model_flops_per_step"].values())
    assert unrolled_flops == pytest.approx(flops, rel=0.02)
    # every scalar at each report: steps 4 and 6 (the first loop, 2, compiles)
    assert sorted(got["perf/examples_per_sec_per_device"]) == [4, 6]
    assert all(v > 0 for v in got["perf/tflops_per_device"].values())


def test_transformer_lm_model_flops_match_the_palm_count(tmp_path):
    p = {"num_layers": 2, "d_model": 64, "num_heads": 4, "max_len": 32, "vocab_size": 64}
    p |= {"write_summaries": False, "learning_rate": 1e-3}
    seq, batch = 32, 16
    tokens = np.random.RandomState(0).randint(0, 64, (batch, seq + 1)).astype(np.int32)

    def input_fn(params):
        while True:
            yield tokens[:, :-1], tokens[:, 1:]

    got = _train_and_read(tmp_path, transformer.model_fn, input_fn, batch, params=p)
    (flops,) = set(got["perf/model_flops_per_step"].values())
    est_params = sum(
        int(np.prod(v.shape))
        for v in jax.tree.leaves(
            transformer._module(p).init(jax.random.key(0), tokens[:1, :-1], train=False)
        )
    )
    matmul_params = est_params - 32 * 64  # the position table is added, not multiplied
    t = batch * seq  # tokens per step
    palm = 6 * matmul_params * t + 12 * p["num_layers"] * p["d_model"] * seq * t
    assert flops == pytest.approx(palm, rel=0.10)


@pytest.mark.counts_compiles
def test_reporting_compiles_nothing_jit_path(tmp_path, caplog):
    # Without the persistent cache the loop runs through jit: its cache holds the program.
    with estimator.core.compilation.CompileCounter() as counter:
        with caplog.at_level(logging.INFO, logger="estimator"):
            got = _train_and_read(tmp_path, _mlp_model_fn, _mlp_input_fn, BATCH)
    assert counter.names.count("jit(loop)") == 1, counter.names
    assert got["perf/model_flops_per_step"]
    (end,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Throughput")]
    assert end.startswith("Throughput over steps 3-6: per device: ")


def test_reporting_compiles_nothing_cached_path(tmp_path):
    # With the suite's persistent cache the loop runs the executable loaded by its trace.
    with estimator.core.compilation.CompileCounter() as counter:
        got = _train_and_read(tmp_path, _mlp_model_fn, _mlp_input_fn, BATCH)
    assert counter.names.count("jit(loop)") == 1, counter.names
    assert got["perf/model_flops_per_step"]


def _loop_with(inner):
    """A rolled loop of ``inner(w, x, key)`` steps, compiled for 4 steps."""

    def loop(w, xs, key):
        def step(w, x):
            return inner(w, x, key), None

        return lax.scan(step, w, xs)[0]

    w = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    xs = jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    return jax.jit(loop).lower(w, xs, key).compile()


def _microbatched(w, x, key):
    def micro(g, xm):
        return g + jax.grad(lambda w: jnp.sum((xm @ w) ** 2))(w), None

    return w - 0.1 * lax.scan(micro, jnp.zeros_like(w), x.reshape(2, 4, 16))[0]


def _with_dropout(w, x, key):
    keep = jax.random.bernoulli(jax.random.wrap_key_data(key), 0.9, x.shape)
    return w - 0.1 * jax.grad(lambda w: jnp.sum((jnp.where(keep, x, 0) @ w) ** 2))(w)


@pytest.mark.parametrize(("inner", "counted"), [(_microbatched, 1), (_with_dropout, 0)])
def test_inner_loops_counts_loops_doing_matrix_math_only(inner, counted):
    # The default job's step held 7 random-bit loops and logged "a lower bound" for them.
    assert throughput.inner_loops(_loop_with(inner), unrolled=False) == counted
