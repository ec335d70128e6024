"""End-to-end behaviour of TPUEstimator against independent references."""

import jax
import numpy as np
import pytest

import estimator
import hooks
from tests import helpers as h

_est = h.make_estimator


@pytest.mark.parametrize("batch_norm", [False, True])
def test_eight_replicas_match_one_device(tmp_path, batch_norm):
    x, y = h.make_data()
    runs = {}
    for use_tpu in (True, False):
        est = _est(tmp_path / str(use_tpu), use_tpu=use_tpu, params={"batch_norm": batch_norm})
        est.train(h.train_input_fn(x, y), max_steps=12)
        runs[use_tpu] = h.params_of(est)
    assert est.num_replicas == 1
    h.assert_params_close(runs[True], runs[False], rtol=2e-4, atol=2e-5)


def test_iterations_per_loop_does_not_change_training(tmp_path):
    x, y = h.make_data()
    runs = []
    for ipl in (1, 5):
        est = _est(tmp_path / str(ipl), ipl=ipl)
        est.train(h.train_input_fn(x, y), steps=10)
        runs.append(h.params_of(est))
    h.assert_params_close(runs[0], runs[1], rtol=1e-5, atol=1e-6)


class _Steps(hooks.SessionRunHook):
    def __init__(self):
        self.loops = []

    def before_run(self, run_context):
        return hooks.SessionRunArgs("global_step")

    def after_run(self, run_context, run_values):
        self.loops.append(run_values.results.tolist())


def test_last_loop_is_shortened_to_land_on_max_steps(tmp_path):
    x, y = h.make_data()
    rec = _Steps()
    est = _est(tmp_path, ipl=4)
    est.train(h.train_input_fn(x, y), max_steps=10, hooks=[rec])
    assert rec.loops == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert est.get_variable_value("global_step") == 10


def test_train_without_steps_runs_until_input_ends(tmp_path):
    x, y = h.make_data(n=80)
    est = _est(tmp_path, ipl=3)

    def finite(params):
        for i in range(0, 80, 16):
            yield {"x": x[i : i + 16]}, y[i : i + 16]

    est.train(finite)
    assert est.get_variable_value("global_step") == 5


def test_resume_equals_uninterrupted(tmp_path):
    x, y = h.make_data()
    one = _est(tmp_path / "one")
    one.train(h.train_input_fn(x, y), max_steps=40)
    _est(tmp_path / "two").train(h.train_input_fn(x, y), steps=20)
    _est(tmp_path / "two").train(h.train_input_fn(x, y), steps=20)
    two = _est(tmp_path / "two")
    assert two.get_variable_value("global_step") == 40
    h.assert_params_close(h.params_of(one), h.params_of(two), rtol=0, atol=0)


def _numpy_reference(est, x, y):
    w1, b1 = est.get_variable_value("hidden/kernel"), est.get_variable_value("hidden/bias")
    w2, b2 = est.get_variable_value("out/kernel"), est.get_variable_value("out/bias")
    logits = np.maximum(x @ w1 + b1, 0) @ w2 + b2
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return logits, -logp[np.arange(len(y)), y].mean(), (logits.argmax(-1) == y).mean()


@pytest.mark.parametrize("n", [77, 96, 5])
def test_eval_and_predict_count_every_example_once(tmp_path, n):
    x, y = h.make_data(n=96)
    est = _est(tmp_path, ipl=2)
    est.train(h.train_input_fn(x, y), max_steps=6)
    xe, ye = h.make_data(n=n, seed=1)
    results = est.evaluate(h.eval_input_fn(xe, ye))
    logits, loss, acc = _numpy_reference(est, xe, ye)
    assert results["global_step"] == 6
    np.testing.assert_allclose(results["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(results["accuracy"], acc, rtol=1e-7)
    preds = list(est.predict(h.eval_input_fn(xe, with_row=True)))
    assert len(preds) == n
    assert [int(p["row"]) for p in preds] == list(range(n))
    np.testing.assert_allclose(np.stack([p["logits"] for p in preds]), logits, rtol=1e-4, atol=1e-5)


def test_predict_keys_and_batches(tmp_path):
    x, y = h.make_data()
    est = _est(tmp_path)
    est.train(h.train_input_fn(x, y), max_steps=2)
    batches = list(
        est.predict(h.eval_input_fn(x[:40]), predict_keys=["logits"], yield_single_examples=False)
    )
    assert [b["logits"].shape for b in batches] == [(16, 3), (16, 3), (8, 3)]
    assert set(batches[0]) == {"logits"}
    with pytest.raises(ValueError, match="nope"):
        list(est.predict(h.eval_input_fn(x[:40]), predict_keys=["nope"]))


def test_second_evaluate_compiles_nothing(tmp_path):
    x, y = h.make_data()
    est = _est(tmp_path)
    est.train(h.train_input_fn(x, y), max_steps=4)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: compiles.append(name) if "backend_compile" in name else None
    )
    est.evaluate(h.eval_input_fn(x, y))
    assert compiles, "the first evaluate must compile its loop (the listener works)"
    compiles.clear()
    est.evaluate(h.eval_input_fn(x, y))
    assert compiles == []


def test_evaluate_steps_limits_batches(tmp_path):
    x, y = h.make_data()
    est = _est(tmp_path, ipl=4)
    est.train(h.train_input_fn(x, y), max_steps=2)
    full = est.evaluate(h.eval_input_fn(x[:32], y[:32]))
    part = est.evaluate(h.eval_input_fn(x, y), steps=2)
    assert part["loss"] == pytest.approx(full["loss"], rel=1e-6)


def test_checkpoints_cadence_and_keep_max(tmp_path):
    x, y = h.make_data()
    est = _est(tmp_path, ipl=2, save_checkpoints_steps=4, keep_checkpoint_max=2)
    est.train(h.train_input_fn(x, y), max_steps=12)
    steps = sorted(int(p.name.split("-")[-1]) for p in tmp_path.glob("model.ckpt-*"))
    assert steps == [8, 12]
    assert est.latest_checkpoint().endswith("/model.ckpt-12")


def test_evaluate_from_checkpoint_path(tmp_path):
    x, y = h.make_data()
    est = _est(tmp_path, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None)
    est.train(h.train_input_fn(x, y), max_steps=4)
    first = est.evaluate(h.eval_input_fn(x, y), checkpoint_path=str(tmp_path / "model.ckpt-2"))
    assert first["global_step"] == 2
    assert est.evaluate(h.eval_input_fn(x, y))["global_step"] == 4


def test_max_steps_already_reached_is_a_no_op(tmp_path, caplog):
    x, y = h.make_data()
    est = _est(tmp_path)
    est.train(h.train_input_fn(x, y), max_steps=4)

    def never(params):
        raise AssertionError("input_fn must not be called")

    est.train(never, max_steps=4)
    assert est.get_variable_value("global_step") == 4


def test_broadcast_and_per_host_v2_train_like_per_host_v1(tmp_path):
    x, y = h.make_data()
    results = {}
    for mode in ("PER_HOST_V1", "PER_HOST_V2"):
        est = _est(
            tmp_path / mode,
            tpu={"per_host_input_for_training": getattr(estimator.InputPipelineConfig, mode)},
        )
        est.train(h.train_input_fn(x, y), max_steps=4)
        results[mode] = h.params_of(est)
    # PER_HOST_V2 pulls one per-replica batch per replica: the same rows in the same order.
    h.assert_params_close(results["PER_HOST_V1"], results["PER_HOST_V2"], rtol=1e-5, atol=1e-6)


def test_params_hold_batch_size_and_context(tmp_path):
    x, y = h.make_data()
    seen = {}

    def model_fn(features, labels, mode, params):
        seen[mode] = (params["batch_size"], params["context"], params["hidden"])
        return h.model_fn(features, labels, mode, params)

    est = estimator.TPUEstimator(
        model_fn,
        config=h.config(tmp_path),
        params={"hidden": 16},
        train_batch_size=32,
        eval_batch_size=16,
    )
    est.train(h.train_input_fn(x, y), max_steps=1)
    est.evaluate(h.eval_input_fn(x, y))
    batch, ctx, hidden = seen["train"]
    assert (batch, hidden) == (4, 16)
    assert (ctx.num_replicas, ctx.num_hosts, ctx.num_cores_per_replica) == (8, 1, 1)
    assert seen["eval"][0] == 2
