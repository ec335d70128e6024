"""ExponentialMovingAverage: TF's decay rule and initialisation, the shadow in checkpoints under
TF's names, evaluate/predict/export reading it, resume, devices and ZeRO (numpy references)."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import estimator
import estimator.core.context
import estimator.weights.moving_average
from estimator.io.export import build_raw_serving_input_receiver_fn, load_saved_model
from estimator.weights.moving_average import MovingAverageState
from tests import helpers as h

X, Y = h.make_data(n=64)
NAMES = ["hidden/bias", "hidden/kernel", "out/bias", "out/kernel"]
AVG = estimator.weights.moving_average.NAME


def make_model_fn(make_tx, *, hidden: int = 16, record: dict | None = None):
    """An MLP whose TRAIN train_op is ``make_tx()`` (called inside model_fn)."""

    def model_fn(features, labels, mode, params):
        hdn = nn.Dense(hidden, name="hidden")(features["x"])
        logits = nn.Dense(3, name="out")(nn.relu(hdn))
        if mode == estimator.ModeKeys.PREDICT:
            return estimator.TPUEstimatorSpec(mode, predictions={"logits": logits})
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        train = mode == estimator.ModeKeys.TRAIN
        return estimator.TPUEstimatorSpec(
            mode,
            loss=loss,
            train_op=make_tx() if train else None,
            eval_metrics=(h.metric_fn, [labels, logits]),
        )

    return model_fn


def _est(tmp_path, name, make_tx, **kw):
    kw.setdefault("ipl", 2)
    model_fn = make_model_fn(make_tx, hidden=kw.pop("hidden", 16))
    return h.make_estimator(tmp_path / name, model_fn, **kw)


def _train(est, steps):
    return est.train(h.train_input_fn(X, Y), max_steps=steps)


def _evaluate(est, **kw):
    out = est.evaluate(h.eval_input_fn(X, Y), **kw)
    return {k: v for k, v in out.items() if k != "global_step"}


def _raw(est):
    return {n: est.get_variable_value(n) for n in NAMES}


def _shadow(est):
    return {n: est.get_variable_value(f"{n}/{AVG}") for n in NAMES}


def _predict(est):
    return np.stack([p["logits"] for p in est.predict(h.eval_input_fn(X))])


@pytest.fixture(scope="module")
def initial(tmp_path_factory):
    """The initial weights: one step of SGD at learning rate 0 (the seed fixes the init)."""
    est = _est(tmp_path_factory.mktemp("init"), "r", lambda: optax.sgd(0.0), ipl=1)
    _train(est, 1)
    return est


def test_decay_and_num_updates_rule():
    assert float(estimator.ExponentialMovingAverage(0.9).decay_at(1)) == pytest.approx(0.9)
    ema = estimator.ExponentialMovingAverage(0.999, num_updates=True)
    for n in (1, 5, 100, 10**6):
        expected = min(0.999, (1 + n) / (10 + n))
        assert float(ema.decay_at(n)) == pytest.approx(expected, rel=1e-6)
    const = estimator.ExponentialMovingAverage(0.999, num_updates=3)
    assert float(const.decay_at(100)) == pytest.approx(4 / 13, rel=1e-6)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="decay"):
        estimator.ExponentialMovingAverage(1.5)
    with pytest.raises(TypeError, match="decay"):
        estimator.ExponentialMovingAverage("0.9")
    with pytest.raises(ValueError, match="num_updates"):
        estimator.ExponentialMovingAverage(0.9, num_updates=-1)
    with pytest.raises(ValueError, match="zero_debias"):
        estimator.ExponentialMovingAverage(0.9, zero_debias=True)
    with pytest.raises(TypeError, match="GradientTransformation"):
        estimator.ExponentialMovingAverage(0.9).apply(0.1)
    tx = estimator.ExponentialMovingAverage(0.9).apply(optax.sgd(0.1))
    params = {"w": np.ones(3, np.float32)}
    with pytest.raises(ValueError, match="params"):
        tx.update(params, tx.init(params))


def test_variables_to_restore_maps_tf_names(monkeypatch):
    monkeypatch.setattr(estimator.core.context, "_LAST", {})  # as before any model_fn was traced
    ema = estimator.ExponentialMovingAverage(0.9)
    expected = {f"{n}/{AVG}": n for n in ("d/bias", "d/kernel")}
    tree = {"d": {"kernel": np.zeros((2, 2)), "bias": np.zeros(2)}}
    assert ema.variables_to_restore(tree) == expected
    assert ema.variables_to_restore(["d/bias:0", "d/kernel"]) == expected
    with pytest.raises(ValueError, match="variables_to_restore"):
        ema.variables_to_restore()  # outside model_fn, never applied
    ema.apply(optax.sgd(0.1)).init(tree)
    assert ema.variables_to_restore() == expected  # the params it was applied to


def test_decay_zero_evaluates_as_the_raw_weights(tmp_path):
    # Last in a chain: the average's state sits inside a tuple of the optimizer state.
    plain = _est(tmp_path, "plain", lambda: optax.chain(optax.clip(0.1), optax.sgd(0.5)))
    ema = estimator.ExponentialMovingAverage(0.0, use_for_eval=True)
    avg = _est(tmp_path, "avg", lambda: optax.chain(optax.clip(0.1), ema.apply(optax.sgd(0.5))))
    _train(plain, 4), _train(avg, 4)
    raw = _raw(avg)
    assert all(np.array_equal(raw[n], _raw(plain)[n]) for n in NAMES)  # EMA changes no update
    assert all(np.array_equal(_shadow(avg)[n], raw[n]) for n in NAMES)
    assert _evaluate(avg) == _evaluate(plain)
    assert _evaluate(_est(tmp_path, "avg", lambda: None)) == _evaluate(plain)  # from disk


def test_decay_one_evaluates_predicts_and_exports_the_initial_weights(tmp_path, initial):
    def make_tx():
        return estimator.ExponentialMovingAverage(1.0, use_for_eval=True).apply(optax.adam(0.05))

    est = _est(tmp_path, "avg", make_tx)
    _train(est, 4)
    init = _raw(initial)
    assert all(np.array_equal(_shadow(est)[n], init[n]) for n in NAMES)
    assert not np.array_equal(_raw(est)["out/kernel"], init["out/kernel"])  # it trained
    expected = _evaluate(initial)
    assert _evaluate(est) == expected  # the trained estimator's own state
    fresh = _est(tmp_path, "avg", make_tx)  # from the checkpoint
    assert _evaluate(fresh) == expected
    np.testing.assert_array_equal(_predict(fresh), _predict(initial))
    fn = build_raw_serving_input_receiver_fn({"x": X[:1]})
    served = load_saved_model(fresh.export_saved_model(str(tmp_path / "export"), fn))
    np.testing.assert_allclose(
        served({"x": X[:8]})["logits"], _predict(initial)[:8], rtol=1e-6, atol=1e-6
    )


def test_middle_decay_with_num_updates_against_numpy(tmp_path, initial):
    decay = 0.3
    seen = {}

    def make_tx():  # TF's idiom: num_updates is the global step, read inside model_fn
        ema = estimator.ExponentialMovingAverage(decay, num_updates=estimator.get_global_step())
        seen["restore"] = ema.variables_to_restore()
        return ema.apply(optax.sgd(0.5))

    est = _est(tmp_path, "avg", make_tx, ipl=1)
    shadow = {n: v.astype(np.float64) for n, v in _raw(initial).items()}
    for step in range(1, 6):
        _train(est, step)
        d = min(decay, (1 + step) / (10 + step))  # steps 1-3 take the rule, 4-5 the decay
        shadow = {n: d * shadow[n] + (1 - d) * _raw(est)[n] for n in NAMES}
    for n in NAMES:
        np.testing.assert_allclose(_shadow(est)[n], shadow[n], rtol=2e-6, atol=1e-7, err_msg=n)
    assert seen["restore"] == {f"{n}/{AVG}": n for n in NAMES}  # from inside model_fn
    listed = dict(estimator.list_variables(str(tmp_path / "avg")))
    assert listed[f"hidden/kernel/{AVG}"] == [6, 16]
    np.testing.assert_array_equal(
        estimator.load_variable(str(tmp_path / "avg"), f"out/bias/{AVG}"), _shadow(est)["out/bias"]
    )
    # Without use_for_eval, evaluation reads the raw weights.
    plain = _est(tmp_path, "plain", lambda: optax.sgd(0.5), ipl=1)
    _train(plain, 5)
    assert _evaluate(est) == _evaluate(plain)


def _every_variable(est):
    return {n: est.get_variable_value(n) for n in est.get_variable_names()}


def test_resume_is_bitwise(tmp_path):
    def make_tx():
        return estimator.ExponentialMovingAverage(0.9, num_updates=True).apply(optax.adam(0.05))

    straight = _est(tmp_path, "straight", make_tx)
    _train(straight, 8)
    first = _est(tmp_path, "resumed", make_tx)
    _train(first, 4)
    _train(_est(tmp_path, "resumed", make_tx), 8)  # a new estimator: from the checkpoint
    a, b = _every_variable(straight), _every_variable(_est(tmp_path, "resumed", make_tx))
    assert sorted(a) == sorted(b) and f"out/kernel/{AVG}" in a
    for n in a:
        assert np.array_equal(a[n], b[n]), n


def test_eight_devices_equal_one_and_zero_shards_the_shadow(tmp_path):
    def make_tx():
        ema = estimator.ExponentialMovingAverage(0.8, use_for_eval=True)
        return ema.apply(optax.adam(0.05))

    runs = {
        "one": _est(tmp_path, "one", make_tx, hidden=256, use_tpu=False),
        "eight": _est(tmp_path, "eight", make_tx, hidden=256),
        "zero": _est(tmp_path, "zero", make_tx, hidden=256, tpu={"shard_optimizer_state": True}),
    }
    results = {}
    for name, est in runs.items():
        _train(est, 4)
        results[name] = (_every_variable(est), _evaluate(est))
    for name in ("eight", "zero"):
        for n, v in results["one"][0].items():
            np.testing.assert_allclose(results[name][0][n], v, rtol=1e-5, atol=1e-6, err_msg=n)
        for k, v in results["one"][1].items():
            assert results[name][1][k] == pytest.approx(v, rel=1e-5, abs=1e-6)
    state = runs["zero"]._job.store.last.state.opt_state
    assert isinstance(state, MovingAverageState)
    kernel = state.ExponentialMovingAverage["hidden"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "data")
    assert kernel.addressable_shards[0].data.shape == (6, 256 // 8)
    mu = state.inner_state[0].mu["hidden"]["kernel"]
    assert kernel.sharding == mu.sharding  # split like the optimizer's slots


def test_ported_saver_route_reads_the_shadow(tmp_path, initial):
    """TF's form: the EVAL model_fn restores ``variables_to_restore()`` through a Saver."""

    def model_fn(features, labels, mode, params):
        hdn = nn.Dense(16, name="hidden")(features["x"])
        logits = nn.Dense(3, name="out")(nn.relu(hdn))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        ema = estimator.ExponentialMovingAverage(1.0)
        if mode == estimator.ModeKeys.TRAIN:
            return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=ema.apply(optax.sgd(0.5)))
        restore = ema.variables_to_restore()
        return estimator.TPUEstimatorSpec(
            mode,
            loss=loss,
            eval_metrics=(h.metric_fn, [labels, logits]),
            scaffold_fn=lambda: estimator.Scaffold(saver=estimator.Saver(restore)),
        )

    est = h.make_estimator(tmp_path / "ported", model_fn, ipl=2)
    _train(est, 4)
    assert _evaluate(h.make_estimator(tmp_path / "ported", model_fn, ipl=2)) == _evaluate(initial)


@pytest.mark.parametrize("made", ["in_model_fn", "outside"])
def test_variables_to_restore_without_arguments_inside_scaffold_fn(tmp_path, initial, made):
    """Issue 41 (item 8): TF allows ``ema.variables_to_restore()`` anywhere, scaffold_fn too,
    where it means the model's trainable variables; an evaluator that never trained (a fresh
    EMA object, never applied) reads the shadow through it."""
    outside = estimator.ExponentialMovingAverage(1.0)

    def model_fn(features, labels, mode, params):
        hdn = nn.Dense(16, name="hidden")(features["x"])
        logits = nn.Dense(3, name="out")(nn.relu(hdn))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        ema = estimator.ExponentialMovingAverage(1.0) if made == "in_model_fn" else outside
        if mode == estimator.ModeKeys.TRAIN:
            train_op = estimator.ExponentialMovingAverage(1.0).apply(optax.sgd(0.5))
            return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=train_op)

        def scaffold_fn():
            return estimator.Scaffold(saver=estimator.Saver(ema.variables_to_restore()))

        return estimator.TPUEstimatorSpec(
            mode, loss=loss, eval_metrics=(h.metric_fn, [labels, logits]), scaffold_fn=scaffold_fn
        )

    _train(h.make_estimator(tmp_path / "run", model_fn, ipl=2), 4)
    evaluator = h.make_estimator(tmp_path / "run", model_fn, ipl=2)
    assert _evaluate(evaluator) == _evaluate(initial)  # decay 1: the initial weights


def test_evaluate_from_disk_looks_for_a_shadow_only_where_the_meta_says_one_was_saved(
    tmp_path, monkeypatch
):
    from estimator.io import checkpoint as ckpt_lib

    plain = _est(tmp_path, "plain", lambda: optax.sgd(0.5))
    ema = estimator.ExponentialMovingAverage(0.5, use_for_eval=True)
    avg = _est(tmp_path, "avg", lambda: ema.apply(optax.sgd(0.5)))
    _train(plain, 2), _train(avg, 2)
    read = []
    original = ckpt_lib.Checkpoints.item_metadata

    def recording(self, step, item):
        read.append(item)
        return original(self, step, item)

    monkeypatch.setattr(ckpt_lib.Checkpoints, "item_metadata", recording)
    expected_plain = _evaluate(plain)
    assert _evaluate(_est(tmp_path, "plain", lambda: None)) == expected_plain
    assert "train" not in read  # the meta said no moving average: nothing else is opened
    assert _evaluate(_est(tmp_path, "avg", lambda: None)) == _evaluate(avg)
    assert "train" in read  # the shadow is found from the train item's metadata
