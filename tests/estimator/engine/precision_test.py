"""Mixed precision: TPUConfig(compute_dtype=...), estimator.tpu.bfloat16_scope(), and float16's
dynamic loss scaling (skip + halve, checkpointed, resumed, summarised as ``loss_scale``)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import estimator
import models
from estimator.engine import precision
from estimator.io.checkpoint import Checkpoints
from tests import helpers as h


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kw, error, words",
    [
        ({"compute_dtype": "bf16"}, ValueError, "compute_dtype"),
        ({"compute_dtype": jnp.bfloat16}, ValueError, "compute_dtype"),
        ({"num_microbatches": 0}, ValueError, "num_microbatches"),
        ({"num_microbatches": 2.0}, TypeError, "num_microbatches"),
        ({"num_microbatches": True}, TypeError, "num_microbatches"),
    ],
)
def test_bad_settings_name_the_argument(kw, error, words):
    with pytest.raises(error, match=words):
        estimator.TPUConfig(**kw)


def test_next_loss_scale_grows_after_a_run_and_halves_on_overflow():
    s = precision.LossScale(jnp.float32(8.0), jnp.int32(0))
    finite, bad = jnp.bool_(True), jnp.bool_(False)
    s = precision.next_loss_scale(s, finite, growth_interval=3)
    s = precision.next_loss_scale(s, finite, growth_interval=3)
    assert (float(s.scale), int(s.good_steps)) == (8.0, 2)
    s = precision.next_loss_scale(s, finite, growth_interval=3)
    assert (float(s.scale), int(s.good_steps)) == (16.0, 0)
    s = precision.next_loss_scale(s, finite, growth_interval=3)
    s = precision.next_loss_scale(s, bad, growth_interval=3)
    assert (float(s.scale), int(s.good_steps)) == (8.0, 0)
    low = precision.LossScale(jnp.float32(1.0), jnp.int32(5))
    assert float(precision.next_loss_scale(low, bad).scale) == 1.0  # TF's floor


# ----------------------------------------------------------------------------- bfloat16
def _recording_model_fn(seen: dict, *, scope: bool = False):
    """The tests' MLP with BatchNorm, recording the dtypes model_fn sees at trace time."""

    def model_fn(features, labels, mode, params):
        seen.setdefault(mode, {})["features"] = features["x"].dtype

        def body(x):
            hidden = nn.Dense(16, name="hidden")(x)
            seen[mode]["hidden"] = hidden.dtype
            hidden = nn.BatchNorm(use_running_average=mode != "train", axis_name="data")(hidden)
            return nn.Dense(3, name="out")(nn.relu(hidden))

        if scope:
            with estimator.tpu.bfloat16_scope():
                logits = body(features["x"])
            seen[mode]["after_block"] = jnp.zeros(2).dtype
        else:
            logits = body(features["x"])
        seen[mode]["logits"] = logits.dtype
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), labels
        ).mean()
        return estimator.TPUEstimatorSpec(
            mode,
            loss=loss,
            train_op=optax.adam(1e-2),
            eval_metrics=(h.metric_fn, [labels, logits]),
            host_call=(lambda x: seen.setdefault("host", x.dtype), [logits]),
        )

    return model_fn


def _train_state_dtypes(model_dir) -> set:
    """Dtypes of every floating leaf of the newest checkpoint's optimizer state, read raw."""
    ckpts = Checkpoints(str(model_dir), read_only=True)
    step = ckpts.steps()[-1]
    shapes = ckpts.saved_shapes(step, "train")
    assert any(name.startswith("opt_state") for name in shapes), shapes
    import orbax.checkpoint as ocp

    raw = ocp.PyTreeCheckpointer().restore(f"{ckpts.path(step)}/train")
    leaves = jax.tree.leaves(raw["opt_state"])
    return {np.asarray(x).dtype for x in leaves if np.issubdtype(np.asarray(x).dtype, np.inexact)}


@pytest.mark.parametrize("scope", [False, True], ids=["compute_dtype", "bfloat16_scope"])
def test_bfloat16_computes_in_bf16_and_keeps_float32_variables(scope, tmp_path):
    seen = {}
    x, y = h.make_data()
    tpu = {} if scope else {"compute_dtype": "bfloat16"}
    est = h.make_estimator(tmp_path, _recording_model_fn(seen, scope=scope), batch=32, tpu=tpu)
    est.train(h.train_input_fn(x, y), max_steps=4)
    est.evaluate(h.eval_input_fn(x, y))
    for mode in ("train", "eval"):
        assert seen[mode]["hidden"] == jnp.bfloat16, seen
        assert seen[mode]["logits"] == jnp.bfloat16, seen
    assert seen["train"]["features"] == (jnp.float32 if scope else jnp.bfloat16)
    if scope:
        assert seen["train"]["after_block"] == jnp.float32  # the block ended
    # What reaches the host: float32 under the policy (bf16 as returned under the scope).
    assert seen["host"] == (jnp.bfloat16 if scope else np.float32)
    values = {n: np.asarray(est.get_variable_value(n)) for n in est.get_variable_names()}
    assert "batch_stats/BatchNorm_0/mean" in values
    floats = {n: v.dtype for n, v in values.items() if n != "global_step"}
    assert set(floats.values()) == {np.dtype(np.float32)}, floats
    assert _train_state_dtypes(tmp_path) == {np.dtype(np.float32)}


def _scoped_mlp_model_fn(features, labels, mode, params):
    with estimator.tpu.bfloat16_scope():
        spec = models.mlp.model_fn(features, labels, mode, params)
    return spec


def _digits_accuracy(model_dir, model_fn, compute_dtype=None, steps=200) -> float:
    from models import datasets

    params = {"hidden": (256, 128), "num_classes": 10, "learning_rate": 3e-3}
    params.update(decay_steps=steps, weight_decay=1e-4, write_summaries=False)
    est = estimator.TPUEstimator(
        model_fn,
        config=h.config(model_dir, iterations_per_loop=steps, tpu={"compute_dtype": compute_dtype}),
        params=params,
        train_batch_size=128,
        eval_batch_size=128,
    )
    fns = datasets.digits()
    est.train(fns["train"], max_steps=steps)
    return est.evaluate(fns["eval"])["accuracy"]


def test_digits_mlp_in_bfloat16_within_two_points_of_float32(tmp_path):
    f32 = _digits_accuracy(tmp_path / "f32", models.mlp.model_fn)
    bf16 = _digits_accuracy(tmp_path / "bf16", models.mlp.model_fn, "bfloat16")
    scoped = _digits_accuracy(tmp_path / "scope", _scoped_mlp_model_fn)
    assert f32 > 0.9, f32
    assert abs(bf16 - f32) <= 0.02, (f32, bf16)
    assert abs(scoped - f32) <= 0.02, (f32, scoped)


def test_bfloat16_with_sharded_params_matches_replicated(tmp_path):
    x, y = h.make_data()
    runs = {}
    for name, tpu in {
        "replicated": {"compute_dtype": "bfloat16"},
        "zero3": {"compute_dtype": "bfloat16", "shard_params": True},
    }.items():
        est = h.make_estimator(tmp_path / name, batch=32, tpu=tpu)
        est.train(h.train_input_fn(x, y), max_steps=6)
        runs[name] = h.params_of(est)
    h.assert_params_close(runs["replicated"], runs["zero3"], rtol=1e-5, atol=1e-6)


def test_export_serves_float32_under_the_policy(tmp_path):
    x, y = h.make_data()
    est = h.make_estimator(tmp_path, batch=32, tpu={"compute_dtype": "bfloat16"})
    est.train(h.train_input_fn(x, y), max_steps=4)
    receiver = estimator.build_raw_serving_input_receiver_fn(
        {"x": np.zeros((1, x.shape[1]), np.float32)}
    )
    path = est.export_saved_model(str(tmp_path / "export"), receiver)
    out = estimator.load_saved_model(path)({"x": x[:8]})
    logits = np.asarray(out["logits"])
    assert logits.dtype == np.float32
    p = h.params_of(est)
    hidden = np.maximum(x[:8] @ p["hidden/kernel"] + p["hidden/bias"], 0)
    want = hidden @ p["out/kernel"] + p["out/bias"]
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)  # float32, not bf16


# ----------------------------------------------------------------------------- float16
@jax.custom_vjp
def _float16_backward(x):
    """Identity whose cotangent is rounded to float16's range and precision.

    XLA:CPU computes float16 with float32 intermediates and drops the roundings between
    them (``xla_allow_excess_precision``), so a float16 gradient neither underflows nor
    overflows there as it does on GPUs and TPUs, which store it in float16. This rounds the
    model output's cotangent as that storage would (``reduce_precision``, kept by XLA).
    """
    return x


def _float16_backward_fwd(x):
    return x, None


def _float16_backward_bwd(_, g):
    return (jax.lax.reduce_precision(g.astype(jnp.float32), exponent_bits=5, mantissa_bits=10),)


_float16_backward.defvjp(_float16_backward_fwd, _float16_backward_bwd)


def _linear_model_fn(*, hand_float16: bool = False, float16_storage: bool = True):
    """y = x @ w with a loss multiplied by ``params["loss_factor"]``: a tiny factor makes the
    backward pass underflow in float16, a large one makes it overflow."""

    def model_fn(features, labels, mode, params):
        dtype = jnp.float16 if hand_float16 else None
        pred = nn.Dense(1, use_bias=False, dtype=dtype, name="w")(features["x"])
        if float16_storage:
            pred = _float16_backward(pred)
        err = pred[:, 0].astype(jnp.float32) - labels
        loss = params["loss_factor"] * jnp.mean(err**2)
        return estimator.TPUEstimatorSpec(
            mode, loss=loss, train_op=optax.sgd(params["lr"]), eval_metrics=None
        )

    return model_fn


def _regression(n=128, d=4):
    rng = np.random.RandomState(0)
    x = rng.randn(n, d).astype(np.float32)
    return x, (x @ rng.randn(d)).astype(np.float32)


def _regression_est(model_dir, *, hand_float16=False, compute_dtype=None, factor, lr, **cfg):
    return h.make_estimator(
        model_dir,
        _linear_model_fn(
            hand_float16=hand_float16, float16_storage=hand_float16 or compute_dtype is not None
        ),
        batch=32,
        ipl=cfg.pop("ipl", 4),
        params={"loss_factor": factor, "lr": lr},
        tpu={"compute_dtype": compute_dtype},
        **cfg,
    )


def test_float16_loss_scaling_trains_where_plain_float16_underflows(tmp_path):
    x, y = _regression()
    # The loss is 1e-8 of a mean squared error: the output's cotangent (~1e-9) is below
    # float16's smallest subnormal (6e-8), so without scaling every gradient is exactly 0.
    factor, lr = 1e-8, 2e6
    plain = _regression_est(tmp_path / "plain", hand_float16=True, factor=factor, lr=lr)
    plain.train(h.train_input_fn(x, y), max_steps=1)
    start = h.params_of(plain)["w/kernel"]
    plain.train(h.train_input_fn(x, y), max_steps=21)
    np.testing.assert_array_equal(h.params_of(plain)["w/kernel"], start)  # nothing learnt

    scaled = _regression_est(tmp_path / "scaled", compute_dtype="float16", factor=factor, lr=lr)
    reference = _regression_est(tmp_path / "f32", factor=factor, lr=lr)
    for est in (scaled, reference):
        est.train(h.train_input_fn(x, y), max_steps=20)
    got, want = h.params_of(scaled)["w/kernel"], h.params_of(reference)["w/kernel"]
    assert not np.allclose(got, start)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-3)  # trains as float32 does


def _scalars(model_dir, tag) -> dict:
    events = EventAccumulator(str(model_dir)).Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def test_float16_overflow_skips_halves_and_the_scale_is_checkpointed(tmp_path):
    x, y = _regression()
    # A large loss: the scaled cotangent overflows float16 until the scale has halved enough.
    cfg = {"factor": 50.0, "lr": 1e-3, "ipl": 2, "save_summary_steps": 1}
    whole = _regression_est(tmp_path / "whole", compute_dtype="float16", **cfg)
    whole.train(h.train_input_fn(x, y), max_steps=16)
    scales = _scalars(tmp_path / "whole", "loss_scale")
    skipped = _scalars(tmp_path / "whole", "nonfinite_steps")
    assert sorted(scales) == list(range(1, 17))
    # Halved on each skipped step (the value after each loop, written for both its steps).
    assert scales[2] == 2.0**13 and skipped[2] == 2
    assert scales[16] < 2.0**13 and scales[16] == scales[14]  # settled: steps are finite
    assert 2 < skipped[16] < 16 and skipped[16] == skipped[14]
    assert scales[16] == 2.0**15 / 2 ** skipped[16]
    assert np.all(np.isfinite(h.params_of(whole)["w/kernel"]))

    # Stopped at 8 and resumed in a new estimator: the same scale sequence and weights.
    halves = _regression_est(tmp_path / "halves", compute_dtype="float16", **cfg)
    halves.train(h.train_input_fn(x, y), max_steps=8)
    ckpts = Checkpoints(str(tmp_path / "halves"), read_only=True)
    import orbax.checkpoint as ocp

    saved = ocp.PyTreeCheckpointer().restore(f"{ckpts.path(8)}/train")["loss_scale"]
    saved_scale = np.asarray(saved["scale"] if isinstance(saved, dict) else saved[0])
    assert saved_scale.dtype == np.float32 and float(saved_scale) == scales[8]
    again = _regression_est(tmp_path / "halves", compute_dtype="float16", **cfg)
    again.train(h.train_input_fn(x, y), max_steps=16)
    assert _scalars(tmp_path / "halves", "loss_scale") == scales
    np.testing.assert_array_equal(h.params_of(again)["w/kernel"], h.params_of(whole)["w/kernel"])
