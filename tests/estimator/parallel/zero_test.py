"""Optimizer state and parameters split over the replicas (ZeRO-1/2/3): same training, less
memory per device, checkpoints that restore into any layout."""

import logging
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import estimator
from estimator.driver.progress import format_bytes
from estimator.parallel import zero
from models import datasets, mlp, transformer
from tests import helpers as h


def _state(est):
    """The TrainState the estimator's last train() left (its final checkpoint's)."""
    return est._job.store.last.state


MODES = {
    "replicated": {},
    "optimizer_state": {"shard_optimizer_state": True},
    "params": {"shard_params": True},
}
STEPS = 20


# ----------------------------------------------------------------- the layout rules
def test_a_leaf_splits_along_its_largest_dimension_the_replicas_divide():
    assert zero.shard_dim((64, 512), P(), num_replicas=8) == 1
    assert zero.shard_dim((512, 64), None, num_replicas=8) == 0
    assert zero.shard_dim((36, 100), P(), num_replicas=8) is None  # nothing divisible by 8
    assert zero.shard_dim((30, 64), P(), num_replicas=8) == 1  # 64 is the only divisible one
    assert zero.shard_dim((64, 64), P(), num_replicas=8) == 0  # ties: the first
    assert zero.shard_dim((10,), P(), num_replicas=8) is None  # under MIN_SHARDED_SIZE
    assert zero.shard_dim((8, 8), P(), num_replicas=8, min_size=1) == 0
    assert zero.shard_dim((4096,), P(), num_replicas=1) is None  # one replica: nothing to split
    assert zero.sharded_spec((10,), P(), num_replicas=8) == P()


def test_a_model_axis_split_is_kept_and_the_data_split_goes_elsewhere():
    assert zero.sharded_spec((64, 512), P(None, "model"), num_replicas=4) == P("data", "model")
    assert zero.sharded_spec((512, 64), P("model"), num_replicas=4) == P("model", "data")
    # The only large dimension is the model-parallel one: replicated over "data".
    assert zero.sharded_spec((4096,), P("model"), num_replicas=4) == P("model")
    assert zero.data_only(P("data", "model")) == P("data")
    assert zero.data_only(P("model", "data")) == P(None, "data")


def test_optimizer_state_mirrors_its_parameters_and_counts_stay_replicated():
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
    specs = {"w": P("data"), "b": P()}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    state = tx.init(params)
    got = zero.optimizer_specs(tx, state, params, specs)
    adam = got[1][0]
    assert adam.mu == specs and adam.nu == specs and adam.count == P()

    class Opaque(optax.GradientTransformation):
        pass  # an init that fails on optax's placeholder: shapes decide

    def init(p):
        return {"slot": jax.tree.map(lambda x: x * 0 + jnp.asarray(x).sum() * 0, p)}

    opaque = Opaque(init, lambda u, s, p=None: (u, s))
    got = zero.optimizer_specs(opaque, init(params), params, specs)
    assert got == {"slot": specs}


def test_gradients_are_reduce_scattered_to_the_global_mean_of_each_slice():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    per_replica = np.random.RandomState(0).randn(8, 16, 24).astype(np.float32)
    grads = {"w": per_replica, "b": per_replica[:, 0, :3]}
    specs = {"w": P(None, "data"), "b": P()}  # w split along its 24 columns, b replicated

    def body(g):
        return zero.scatter_gradients(jax.tree.map(lambda x: x[0], g), specs)

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=specs, check_vma=False)
    )
    out = fn(grads)
    np.testing.assert_allclose(out["w"], per_replica.mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["b"], per_replica[:, 0, :3].mean(0), rtol=1e-6)
    assert {s.data.shape for s in out["w"].addressable_shards} == {(16, 3)}
    text = fn.lower(grads).as_text()
    assert "reduce_scatter" in text and "all_reduce" in text  # w scattered, b all-reduced


def test_job_configs_set_the_flags():
    from estimator.cli import jobs

    config = jobs.load_config("transformer_lm")
    assert not jobs.run_config(config, None).tpu_config.shard_params
    jobs.apply_overrides(config, {"shard_params": "True", "shard_optimizer_state": "True"})
    tpu = jobs.run_config(config, None).tpu_config
    assert tpu.shard_params and tpu.shard_optimizer_state


def test_the_flags_must_be_bools():
    with pytest.raises(TypeError, match="shard_params"):
        estimator.TPUConfig(shard_params="yes")
    with pytest.raises(TypeError, match="shard_optimizer_state"):
        estimator.TPUConfig(shard_optimizer_state=1)


# ----------------------------------------------------------------- the digits MLP, 8 replicas
def _digits_with_a_nan_batch(at: int):
    train = datasets.digits()["train"]

    def input_fn(params):
        for i, (x, y) in enumerate(train(params)):
            yield (np.full_like(x, np.nan) if i == at else x), y

    return input_fn


class _HostCalls:
    """host_call records: steps it ran for (the model's summaries host_call runs too)."""

    def __init__(self):
        self.steps = []


def _mlp_estimator(model_dir, mode, *, use_tpu=True, record=None):
    """The zoo's digits MLP (64-128-64-10) with Adam; ``record`` gets host_call's steps."""

    def model_fn(features, labels, mode, params):
        train = mode == estimator.ModeKeys.TRAIN
        logits = mlp.MLP(hidden=(128, 64))(features, train=train)
        if mode == estimator.ModeKeys.PREDICT:
            ids = logits.argmax(-1)
            return estimator.TPUEstimatorSpec(
                mode, predictions={"class_ids": ids}, export_outputs={"class_ids": ids}
            )
        host_call = None
        if train and record is not None:
            step = estimator.get_global_step()
            host_call = (lambda s: record.steps.extend(np.ravel(s).tolist()), [step[None]])
        return estimator.TPUEstimatorSpec(
            mode,
            loss=mlp.masked_cross_entropy(logits, labels),
            train_op=optax.adam(3e-3),
            eval_metrics=(mlp.classification_metric_fn, [labels, logits]),
            host_call=host_call,
        )

    return h.make_estimator(
        model_dir,
        model_fn,
        batch=64,
        ipl=5,
        use_tpu=use_tpu,
        tpu=MODES[mode],
        skip_nonfinite_steps=True,
    )


def _per_device_bytes(tree, device) -> int:
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        for s in x.addressable_shards
        if s.device == device
    )


def _small_leaf_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if x.size < zero.MIN_SHARDED_SIZE)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def mlp_runs(tmp_path_factory):
    """Each mode trained 20 steps (4 loops of 5, one batch of NaNs skipped) on 8 replicas;
    with the estimator's log lines."""
    runs = {}
    log = logging.getLogger("estimator")
    for mode in MODES:
        model_dir = tmp_path_factory.mktemp(mode)
        record, lines = _HostCalls(), _Lines()
        est = _mlp_estimator(model_dir, mode, record=record)
        log.addHandler(lines)
        level = log.level
        log.setLevel(logging.INFO)
        try:
            est.train(_digits_with_a_nan_batch(at=7), max_steps=STEPS)
        finally:
            log.removeHandler(lines)
            log.setLevel(level)
        record.lines = lines.lines
        runs[mode] = (est, record, model_dir)
    return runs


@pytest.mark.parametrize("mode", ["optimizer_state", "params"])
def test_mlp_trains_to_the_same_params_as_replicated(mlp_runs, mode):
    base, sharded = mlp_runs["replicated"][0], mlp_runs[mode][0]
    h.assert_params_close(h.params_of(base), h.params_of(sharded), rtol=1e-5, atol=1e-6)
    for est in (base, sharded):  # the NaN batch was skipped, on every replica together
        assert int(_state(est).nonfinite) == 1
        assert int(_state(est).step) == STEPS
    # host_call ran every step, in order, on every replica's rows, in both layouts
    expected = [step for step in range(STEPS) for _ in range(8)]
    assert mlp_runs[mode][1].steps == mlp_runs["replicated"][1].steps == expected


@pytest.mark.parametrize("mode", ["optimizer_state", "params"])
def test_each_device_holds_an_eighth_of_the_optimizer_state(mlp_runs, mode):
    state = _state(mlp_runs[mode][0])
    device = jax.devices()[0]
    total = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
    held = _per_device_bytes(state.opt_state, device)
    assert held <= total / 8 + _small_leaf_bytes(state.opt_state)
    assert held < total / 4  # most of it is split
    full = _state(mlp_runs["replicated"][0])
    assert _per_device_bytes(full.opt_state, device) == total
    params = sum(x.nbytes for x in jax.tree.leaves(state.params))
    held_params = _per_device_bytes(state.params, device)
    if mode == "params":
        assert held_params <= params / 8 + _small_leaf_bytes(state.params)
    else:
        assert held_params == params  # ZeRO-1/2: parameters stay whole between steps


@pytest.mark.parametrize("mode", list(MODES))
def test_the_startup_line_reports_bytes_per_device(mlp_runs, mode):
    est, record, _ = mlp_runs[mode]
    line = next(line for line in record.lines if "per device" in line)
    # the state at the start had the layout the final state has: measure that one
    state, device = _state(est), jax.devices()[0]
    params, opt = (
        _per_device_bytes(state.params, device),
        _per_device_bytes(state.opt_state, device),
    )
    assert f"parameters {format_bytes(params)}, optimizer state {format_bytes(opt)}" in line


def test_sharded_checkpoint_restores_on_one_device_with_the_same_evaluation(mlp_runs):
    sharded, _, model_dir = mlp_runs["params"]
    eval_fn = datasets.digits()["eval"]
    on_8 = sharded.evaluate(eval_fn)  # the live, split state, gathered for evaluation
    on_1 = _mlp_estimator(model_dir, "replicated", use_tpu=False).evaluate(eval_fn)
    assert on_8["global_step"] == on_1["global_step"] == STEPS
    for key in ("loss", "accuracy"):
        assert on_1[key] == pytest.approx(on_8[key], rel=1e-5), key


def test_replicated_checkpoint_resumes_split_and_matches_resuming_replicated(mlp_runs, tmp_path):
    _, _, model_dir = mlp_runs["replicated"]
    resumed = {}
    for mode in ("replicated", "params"):  # the replicated checkpoint, restored, trains on
        shutil.copytree(model_dir, tmp_path / mode)
        est = _mlp_estimator(tmp_path / mode, mode)
        est.train(datasets.digits()["train"], max_steps=STEPS + 5)
        resumed[mode] = est
    base = h.params_of(resumed["replicated"])
    h.assert_params_close(base, h.params_of(resumed["params"]), rtol=1e-5, atol=1e-6)
    split = [  # leaves whose 8 devices hold 8 different slices
        x
        for x in jax.tree.leaves(_state(resumed["params"]).params)
        if len({str(s.index) for s in x.addressable_shards}) == 8
    ]
    assert split


def test_export_gathers_full_parameters(mlp_runs, tmp_path):
    est = mlp_runs["params"][0]
    fns = datasets.digits()
    x = np.concatenate([b[0] for b in fns["eval"]({"batch_size": 64})])
    want = np.array([p["class_ids"] for p in est.predict(fns["predict"])])
    fn = estimator.build_raw_serving_input_receiver_fn(x[:1])
    model = estimator.load_saved_model(est.export_saved_model(str(tmp_path / "export"), fn))
    np.testing.assert_array_equal(model(x)["class_ids"], want)


# ----------------------------------------------------------------- the zoo's Transformer LM
def _tokens(params):
    rng = np.random.RandomState(0)
    b = params["batch_size"]
    while True:
        t = rng.randint(0, 256, (b, 17)).astype(np.int32)
        yield t[:, :-1], t[:, 1:]


def _lm(model_dir, mode):
    params = {
        "num_layers": 1,
        "num_heads": 2,
        "d_model": 32,
        "mlp_dim": 64,
        "max_len": 16,
        "learning_rate": 3e-3,
        "warmup_steps": 2,
        "decay_steps": 40,
        "grad_clip": 0.05,  # small, so clipping by the global norm acts on every step
        "write_summaries": False,
    }
    return estimator.TPUEstimator(
        transformer.model_fn,
        config=h.config(model_dir, iterations_per_loop=10, tpu=MODES[mode]),
        params=params,
        train_batch_size=16,
    )


def test_transformer_lm_with_global_norm_clipping_trains_the_same_in_every_layout(tmp_path):
    got = {}
    for mode in MODES:
        est = _lm(tmp_path / mode, mode)
        est.train(_tokens, max_steps=STEPS)
        got[mode] = est
    # Clipping acts: the gradient's global norm at the trained params exceeds grad_clip.
    lm_params = _state(got["replicated"]).params["TransformerLM_0"]
    tokens, labels = next(_tokens({"batch_size": 16}))
    module = transformer._module(_lm(tmp_path / "probe", "replicated").params)

    def loss(p):
        logits = module.apply({"params": p}, tokens, train=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    assert float(optax.tree.norm(jax.grad(loss)(lm_params))) > 4 * 0.05
    base = h.params_of(got["replicated"])
    embed = base["TransformerLM_0/embed/embedding"]
    assert embed.shape == (256, 32) and embed.size >= zero.MIN_SHARDED_SIZE
    # The attention key bias has an exactly zero gradient (softmax ignores a constant added to
    # a query's logits), so Adam turns float noise into its steps: compare it only in size.
    noise = "TransformerLM_0/block_0/attn/key/bias"
    for mode in ("optimizer_state", "params"):
        other = h.params_of(got[mode])
        assert np.abs(base[noise]).max() < 1e-4 and np.abs(other[noise]).max() < 1e-4
        h.assert_params_close(
            {k: v for k, v in base.items() if k != noise},
            {k: v for k, v in other.items() if k != noise},
            rtol=1e-5,
            atol=1e-6,
        )
        opt = _state(got[mode]).opt_state
        total = sum(x.nbytes for x in jax.tree.leaves(opt))
        held = _per_device_bytes(opt, jax.devices()[0])
        assert held <= total / 8 + _small_leaf_bytes(opt)
    assert all(np.isfinite(v).all() for v in base.values())


# ----------------------------------------------------------------- with a "model" axis
def _model_parallel_fn(features, labels, mode, params):
    """An MLP whose 16x256 hidden kernel is split over "model" (nn.with_partitioning)."""
    init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    hidden = nn.Dense(256, name="hidden", kernel_init=init)(features["x"])
    logits = nn.Dense(3, name="out")(nn.relu(hidden))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.adam(1e-2))


def test_split_params_compose_with_a_model_axis(tmp_path):
    x, y = h.make_data(n=64, d=16)
    got = {}
    for mode in ("replicated", "params"):
        tpu = {"num_cores_per_replica": 2, **MODES[mode]}
        est = estimator.TPUEstimator(
            _model_parallel_fn,
            config=h.config(tmp_path / mode, iterations_per_loop=4, tpu=tpu),
            train_batch_size=16,
        )
        est.train(h.train_input_fn(x, y), max_steps=4)
        got[mode] = est
    h.assert_params_close(
        h.params_of(got["replicated"]), h.params_of(got["params"]), rtol=1e-5, atol=1e-6
    )
    kernel = _state(got["params"]).params["hidden"]["kernel"]
    assert kernel.sharding.spec == P("data", "model")  # 4 replicas x 2 cores
    assert {s.data.shape for s in kernel.addressable_shards} == {(4, 128)}
    mu = _state(got["params"]).opt_state[0].mu["hidden"]["kernel"]
    assert mu.sharding.spec == P("data", "model")
