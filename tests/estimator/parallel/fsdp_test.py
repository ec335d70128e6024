"""FSDP (``shard_params=True``): each parameter gathered where it is used, never the whole
model; gradients reduce-scattered leaf by leaf; less memory per device than ZeRO-1, which
has less than replicated (XLA's ``memory_analysis`` of the compiled loops)."""

import logging
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import estimator
from estimator.driver import progress
from estimator.parallel import fsdp, zero
from models import transformer
from tests import helpers as h

MODES = {
    "replicated": {},
    "optimizer_state": {"shard_optimizer_state": True},
    "params": {"shard_params": True},
}
WIDTH, FEATURES = 512, 32


def _mlp_fn(features, labels, mode, params):
    """32-512-512-10 with Adam: three kernels large enough to split 8 ways."""
    x = features["x"] if isinstance(features, dict) else features
    for _ in range(2):
        x = nn.relu(nn.Dense(WIDTH)(x))
    logits = nn.Dense(10)(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.adam(1e-3))


def _data():
    rng = np.random.RandomState(0)
    x = rng.randn(64, FEATURES).astype(np.float32)
    return x, rng.randint(0, 10, 64).astype(np.int32)


def _trained(tmp_path, mode, model_fn=_mlp_fn, steps=2):
    x, y = _data()
    est = h.make_estimator(tmp_path / mode, model_fn, batch=16, ipl=2, tpu=MODES[mode])
    est.train(h.train_input_fn(x, y, features_dict=False), max_steps=steps)
    return est


def _compiled_loop(est):
    state = est._job.store.last.state
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )
    sharding = NamedSharding(est.mesh, P(None, "data"))
    xs = jax.ShapeDtypeStruct((2, 16, FEATURES), jnp.float32, sharding=sharding)
    ys = jax.ShapeDtypeStruct((2, 16), jnp.int32, sharding=sharding)
    loop = est._job.programs.train_for(abstract, 16 // est.num_replicas)
    return loop.lower(abstract, xs, ys).compile()


def _split_leaves(est) -> list:
    """The trained parameters split over the 8 replicas (8 distinct shards)."""
    leaves = jax.tree.leaves(est._job.store.last.state.params)
    return [x for x in leaves if len({str(s.index) for s in x.addressable_shards}) == 8]


def test_each_parameter_is_gathered_alone_and_memory_falls_with_each_mode(tmp_path):
    ests = {mode: _trained(tmp_path, mode) for mode in MODES}
    compiled = {mode: _compiled_loop(est) for mode, est in ests.items()}
    text = compiled["params"].as_text()
    gathered = re.findall(r"= (f32\[[0-9,]+\])\{[0-9,]+\} all-gather\(", text)
    # one gather per split leaf, each of that leaf's own shape: no whole-model gather
    split = [x.shape for x in _split_leaves(ests["params"])]
    assert len(split) == 3
    shapes = {tuple(int(d) for d in g[4:-1].split(",")) for g in gathered}
    assert shapes == set(split), gathered
    # gradients leave the backward pass reduce-scattered, leaf by leaf
    assert len(re.findall(r"reduce-scatter\(", text)) >= 3
    peak = {m: progress.program_memory(c)["peak"] for m, c in compiled.items()}
    args = {m: progress.program_memory(c)["arguments"] for m, c in compiled.items()}
    assert peak["params"] < peak["optimizer_state"] < peak["replicated"], peak
    # between steps a device holds 1/8 of the split leaves (plus the small ones and inputs)
    assert args["params"] < args["replicated"] / 4, args


def test_the_gradient_through_the_gathers_is_the_global_mean_split_like_the_parameter():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    rng = np.random.RandomState(0)
    params = {
        "w1": rng.randn(16, 24).astype(np.float32),
        "w2": rng.randn(24, 24).astype(np.float32) / 5,
        "b": rng.randn(3).astype(np.float32),
    }
    x = rng.randn(8, 4, 16).astype(np.float32)  # each replica's rows
    specs = {"w1": P(None, "data"), "w2": P("data"), "b": P()}

    def loss(p, rows):
        h = jnp.tanh(jnp.tanh(rows @ p["w1"]) @ p["w2"])
        return jnp.sum(h[:, :3] * p["b"])

    def body(p, rows):
        def of_slices(q):
            return loss(zero.gather_params(q, specs), rows[0])

        q = {**p, "b": lax.pcast(p["b"], "data", to="varying")}
        g = jax.grad(fsdp.gathered_at_use(of_slices))(q)
        return zero.scattered_mean(g, specs)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data")), out_specs=specs))
    got = fn(params, x)
    per_replica = [jax.grad(loss)(params, x[r]) for r in range(8)]
    want = jax.tree.map(lambda *g: np.mean(g, 0), *per_replica)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert {s.data.shape for s in got["w1"].addressable_shards} == {(16, 3)}
    assert {s.data.shape for s in got["w2"].addressable_shards} == {(3, 24)}
    # w1 and w2 gathered for the forward pass; the backward pass gathers w2 again for the
    # gradient of its input rather than keep the forward's copy (w1's is not needed)
    compiled = fn.lower(params, x).compile().as_text()
    assert len(re.findall(r"all-gather\(", compiled)) == 3


def _deep_fn(features, labels, mode, params):
    """Six equal 512x512 layers: the gathered model (6 MiB) dwarfs one layer (1 MiB)."""
    x = nn.Dense(WIDTH)(features)
    for _ in range(6):
        x = nn.tanh(nn.Dense(WIDTH, use_bias=False)(x))
    logits = nn.Dense(10)(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(1e-2))


def test_a_step_holds_one_gathered_layer_at_a_time_not_the_whole_model(tmp_path):
    est = _trained(tmp_path, "params", _deep_fn)
    compiled = _compiled_loop(est)
    text, m = compiled.as_text(), progress.program_memory(compiled)
    layer = WIDTH * WIDTH * 4
    # Gathered at the top of the step (as XLA:CPU schedules per-leaf gathers left alone), the
    # six kernels were live together: at least 6 MiB of temporaries. Gathered at their use,
    # the step holds a gathered kernel and one whole gradient before its reduce-scatter.
    assert m["temporaries"] < 3 * layer, m
    # each kernel is gathered for its forward use and again for its backward pass
    assert len(re.findall(r"= f32\[512,512\]\{[0-9,]+\} all-gather\(", text)) >= 12
    # (the same training as replicated: zero_test's MLP and Transformer LM equivalence tests)


class _Layer(nn.Module):
    width: int = WIDTH

    @nn.compact
    def __call__(self, x, _):
        return nn.tanh(nn.Dense(self.width, use_bias=False)(x)), None


def _stack_fn(*, length=6, width=WIDTH, remat=False):
    """A stack of equal layers as one ``nn.scan`` (stacked kernels [length, width, width]),
    each layer rematerialised when ``remat``: how MaxText-style programs write a deep model."""

    def model_fn(features, labels, mode, params):
        x = nn.Dense(width)(features)
        layer = nn.remat(_Layer) if remat else _Layer
        stack = nn.scan(
            layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=length
        )
        x, _ = stack(width)(x, None)
        logits = nn.Dense(10)(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(1e-2))

    return model_fn


class _ScannedBlock(nn.Module):
    """The zoo's pre-LayerNorm decoder block (attention and MLP) as one scan iteration."""

    @nn.compact
    def __call__(self, x, mask):
        return transformer.DecoderBlock(num_heads=4, mlp_dim=256)(x, mask, train=True), None


def _scanned_lm_fn(features, labels, mode, params):
    """A 3-block language model written as MaxText writes one: the blocks one ``nn.scan``."""
    tokens = features.astype(jnp.int32) % 64
    x = nn.Embed(64, 64)(tokens)
    mask = nn.make_causal_mask(tokens)
    blocks = nn.scan(
        _ScannedBlock,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=nn.broadcast,
        length=3,
    )
    x, _ = blocks()(x, mask)
    logits = nn.Dense(10)(nn.LayerNorm()(x).mean(axis=1))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    # SGD: the key projection's bias has an exactly zero gradient (softmax ignores a shift
    # shared by a query's logits), which Adam would turn from float noise into whole steps
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.1))


def test_scanned_transformer_blocks_train_split_as_replicated(tmp_path):
    got = {m: _trained(tmp_path, m, _scanned_lm_fn, steps=4) for m in ("replicated", "params")}
    h.assert_params_close(
        h.params_of(got["replicated"]), h.params_of(got["params"]), rtol=1e-4, atol=1e-5
    )
    split = [x.shape for x in _split_leaves(got["params"]) if x.ndim >= 3]
    assert len(split) >= 5, split  # query, key, value, out, mlp_in, mlp_out stacks
    # each block's kernels are gathered inside the scan, one block at a time
    text = _compiled_loop(got["params"]).as_text()
    gathered = re.findall(r"= f32\[([0-9,]+)\]\{[0-9,]+\} all-gather\(", text)
    assert gathered and not [g for g in gathered if g.startswith("3,")], gathered


def _stacked_kernel(est):
    (kernel,) = [x for x in jax.tree.leaves(est._job.store.last.state.params) if x.ndim == 3]
    return kernel


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan_of_remat"])
def test_a_scanned_stack_is_gathered_one_layer_at_a_time(tmp_path, remat):
    got = {m: _trained(tmp_path, m, _stack_fn(remat=remat)) for m in ("replicated", "params")}
    h.assert_params_close(
        h.params_of(got["replicated"]), h.params_of(got["params"]), rtol=1e-5, atol=1e-6
    )
    compiled = _compiled_loop(got["params"])
    text, m = compiled.as_text(), progress.program_memory(compiled)
    # the stacked kernel is split over "data" along a layer's dimension ...
    assert {s.data.shape for s in _stacked_kernel(got["params"]).addressable_shards} == {
        (6, WIDTH // 8, WIDTH)
    }
    # ... and gathered a layer at a time inside the scan, forward and backward: never the
    # stack (6 MiB gathered at once, 24 MiB of temporaries before)
    assert not re.search(r"= f32\[6,512,512\]\{[0-9,]+\} all-gather\(", text)
    assert len(re.findall(r"= f32\[512,512\]\{[0-9,]+\} all-gather\(", text)) >= 2
    assert m["temporaries"] < 3 * WIDTH * WIDTH * 4, m


def test_a_stack_split_along_its_scanned_axis_is_gathered_whole_and_trains_the_same(tmp_path):
    """16 layers of 8x8: the stacked kernel's largest dimension, the one split, is the
    scanned one, so no iteration's slice can be gathered alone."""
    fn = _stack_fn(length=16, width=8)
    got = {m: _trained(tmp_path, m, fn) for m in ("replicated", "params")}
    h.assert_params_close(
        h.params_of(got["replicated"]), h.params_of(got["params"]), rtol=1e-5, atol=1e-6
    )
    assert {s.data.shape for s in _stacked_kernel(got["params"]).addressable_shards} == {(2, 8, 8)}


class _Shared(nn.Module):
    """One kernel read by two equations (as a tied embedding is)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("kernel", nn.initializers.lecun_normal(), (WIDTH, WIDTH))
        return jnp.tanh(jnp.tanh(x @ w) @ w.T)


def _shaped_fn(kind):
    """A model_fn whose split parameters reach the step through nn.remat, nn.scan (one
    equation for three stacked layers, or an RNN's one kernel read at every step) or two
    uses of one kernel."""

    def model_fn(features, labels, mode, params):
        x = nn.Dense(WIDTH)(features)
        if kind == "remat":
            x = nn.remat(nn.Dense)(WIDTH)(x)
        elif kind == "scan":
            scanned = nn.scan(
                _Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
            )
            x, _ = scanned()(x, None)
        elif kind == "rnn":  # one kernel read by every iteration of a scan
            cell = nn.scan(
                _Layer, variable_broadcast="params", split_rngs={"params": False}, length=4
            )
            x, _ = cell()(x, None)
        else:
            x = _Shared()(x)
        logits = nn.Dense(10)(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        # SGD: Adam would turn the float reassociation of the shared kernel's two gradient
        # parts (summed after their reduce-scatters, not before) into whole steps where a
        # gradient is near zero
        return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.1))

    return model_fn


@pytest.mark.parametrize("kind", ["remat", "scan", "rnn", "shared"])
def test_remat_scan_and_a_shared_kernel_train_split_as_replicated(tmp_path, kind):
    got = {m: _trained(tmp_path, m, _shaped_fn(kind)) for m in ("replicated", "params")}
    h.assert_params_close(
        h.params_of(got["replicated"]), h.params_of(got["params"]), rtol=1e-5, atol=1e-6
    )


def _cross_replica_bn_fn(features, labels, mode, params):
    """BatchNorm over the replicas: model_fn names "data" while it initialises."""
    # No bias before BatchNorm: its gradient is exactly zero in exact arithmetic, so Adam would
    # turn float noise into full steps, and the noise differs with XLA's code generation.
    x = nn.Dense(WIDTH, use_bias=False)(features)
    x = nn.BatchNorm(use_running_average=mode != estimator.ModeKeys.TRAIN, axis_name="data")(x)
    logits = nn.Dense(10)(nn.relu(x))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.adam(1e-3))


def test_a_model_that_initialises_over_the_replicas_still_trains_split(tmp_path):
    got = {m: _trained(tmp_path, m, _cross_replica_bn_fn) for m in ("replicated", "params")}
    h.assert_params_close(
        h.params_of(got["replicated"]), h.params_of(got["params"]), rtol=1e-5, atol=1e-6
    )
    kernel = got["params"]._job.store.last.state.params["Dense_0"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(FEATURES, WIDTH // 8)}


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_the_startup_debug_line_gives_the_train_loop_memory_per_device(tmp_path):
    log = logging.getLogger("estimator")
    lines, level = _Lines(), log.level
    log.addHandler(lines)
    log.setLevel(logging.DEBUG)
    try:
        est = _trained(tmp_path, "params")
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    line = next(x for x in lines.lines if x.startswith("Train loop memory per device"))
    m = progress.program_memory(_compiled_loop(est))
    assert f"temporaries {progress.format_bytes(m['temporaries'])}" in line
    assert f"peak {progress.format_bytes(m['peak'])}" in line
    assert "one device" in line
