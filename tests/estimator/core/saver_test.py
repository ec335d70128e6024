"""``Saver(var_list)`` in ``Scaffold(saver=...)`` and checkpoints holding more variables than
the model (issue 27, items 3 and 4), written as EfficientNet writes its EMA evaluation.

The checkpoint comes from a model with extra variables (a second pair of layers, standing in
for EMA shadows under other names); the model evaluated has only ``hidden`` and ``out``.
Every result is checked against numpy run on the checkpoint values the mapping names.
"""

from __future__ import annotations

import logging
import shutil

import flax.linen as nn
import numpy as np
import optax
import pytest

import estimator
from tests import helpers as h

X, Y = h.make_data(n=48, d=6, classes=3, seed=3)
MAPPING = {  # {checkpoint name: model variable}, as ema.variables_to_restore() gives it
    "shadow_hidden/kernel": "hidden/kernel",
    "shadow_hidden/bias": "hidden/bias",
    "shadow_out/kernel": "out/kernel",
    "shadow_out/bias": "out/bias",
}


def _net(x, prefix=""):
    hidden = nn.relu(nn.Dense(8, name=f"{prefix}hidden")(x))
    return nn.Dense(3, name=f"{prefix}out")(hidden)


def writer_model_fn(features, labels, mode, params):
    """Trains two copies of the net: the second stands in for weights stored under other
    names (an EMA run's ``<var>/ExponentialMovingAverage``)."""
    x = features["x"]
    logits, shadow = _net(x), _net(x, "shadow_")
    xent = optax.softmax_cross_entropy_with_integer_labels
    loss = xent(logits, labels).mean() + xent(shadow * 2.0, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.3))


def reader_model_fn(features, labels, mode, params):
    """EfficientNet's evaluation form: the scaffold's Saver names what to restore."""
    logits = _net(features["x"])
    scaffold_fn = None
    if params.get("var_list") is not None:

        def scaffold_fn():
            return estimator.Scaffold(saver=estimator.Saver(params["var_list"]))

    if mode == estimator.ModeKeys.PREDICT:
        return estimator.TPUEstimatorSpec(
            mode, predictions={"logits": logits}, scaffold_fn=scaffold_fn
        )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(
        mode,
        loss=loss,
        train_op=optax.sgd(0.1),
        eval_metrics=(h.metric_fn, [labels, logits]),
        scaffold_fn=scaffold_fn,
    )


def _numpy_logits(values: dict, x: np.ndarray, prefix: str = "") -> np.ndarray:
    hidden = np.maximum(x @ values[f"{prefix}hidden/kernel"] + values[f"{prefix}hidden/bias"], 0)
    return hidden @ values[f"{prefix}out/kernel"] + values[f"{prefix}out/bias"]


def _numpy_loss(logits: np.ndarray, y: np.ndarray) -> float:
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean())


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A checkpoint with both nets, and its values by name."""
    model_dir = tmp_path_factory.mktemp("writer")
    est = h.make_estimator(model_dir, writer_model_fn)
    est.train(h.train_input_fn(X, Y), max_steps=4)
    values = {n: est.get_variable_value(n) for n in est.get_variable_names()}
    assert not np.allclose(values["hidden/kernel"], values["shadow_hidden/kernel"])
    return model_dir, values


def _reader(tmp_path, var_list=None, **kw):
    return h.make_estimator(tmp_path, reader_model_fn, params={"var_list": var_list}, **kw)


@pytest.mark.parametrize("use_tpu", [True, False], ids=["8-devices", "1-device"])
def test_evaluate_and_predict_read_the_values_the_saver_maps(tmp_path, written, use_tpu):
    model_dir, values = written
    est = _reader(tmp_path, MAPPING, use_tpu=use_tpu)
    result = est.evaluate(h.eval_input_fn(X, Y), checkpoint_path=str(model_dir))
    want = _numpy_logits(values, X, "shadow_")
    assert result["loss"] == pytest.approx(_numpy_loss(want, Y), rel=1e-5)
    assert result["global_step"] == 4
    got = np.stack(
        [p["logits"] for p in est.predict(h.eval_input_fn(X), checkpoint_path=str(model_dir))]
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_export_reads_the_values_the_saver_maps(tmp_path, written):
    model_dir, values = written
    est = _reader(tmp_path / "run", MAPPING)
    serving = estimator.build_raw_serving_input_receiver_fn({"x": np.zeros((1, 6), np.float32)})
    path = est.export_saved_model(str(tmp_path / "export"), serving, checkpoint_path=str(model_dir))
    out = estimator.load_saved_model(path)({"x": X})
    np.testing.assert_allclose(
        out["logits"], _numpy_logits(values, X, "shadow_"), rtol=1e-5, atol=1e-5
    )


def ema_like_model_fn(features, labels, mode, params):
    """Trains both nets; evaluates and predicts the second through a Saver (EMA's shape)."""
    if mode == estimator.ModeKeys.TRAIN:
        return writer_model_fn(features, labels, mode, params)
    return reader_model_fn(features, labels, mode, {**params, "var_list": MAPPING})


def test_a_saver_applies_right_after_training_in_the_same_estimator(tmp_path):
    """Evaluating right after train() in the same estimator reads through the Saver too,
    not the training state it holds in memory."""
    est = h.make_estimator(tmp_path, ema_like_model_fn)
    est.train(h.train_input_fn(X, Y), max_steps=2)
    values = {n: est.get_variable_value(n) for n in est.get_variable_names()}
    result = est.evaluate(h.eval_input_fn(X, Y))
    want = _numpy_logits(values, X, "shadow_")
    assert result["loss"] == pytest.approx(_numpy_loss(want, Y), rel=1e-5)


def test_a_saver_list_restores_each_from_its_own_name(tmp_path, written):
    model_dir, values = written
    est = _reader(tmp_path, ["hidden/kernel", "hidden/bias"])
    result = est.evaluate(h.eval_input_fn(X, Y), checkpoint_path=str(model_dir))
    assert result["loss"] == pytest.approx(_numpy_loss(_numpy_logits(values, X), Y), rel=1e-5)


def test_extra_checkpoint_variables_are_named_once_and_read_around(tmp_path, written, caplog):
    """An EMA run evaluated with EMA off: the model's own variables are read, the rest named
    once in the log."""
    model_dir, values = written
    model_dir = shutil.copytree(model_dir, tmp_path / "copy")  # not yet read in this process
    est = _reader(tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="estimator"):
        first = est.evaluate(h.eval_input_fn(X, Y), checkpoint_path=str(model_dir))
        est.evaluate(h.eval_input_fn(X, Y), checkpoint_path=str(model_dir))
    assert first["loss"] == pytest.approx(_numpy_loss(_numpy_logits(values, X), Y), rel=1e-5)
    notes = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert len(notes) == 1 and "shadow_hidden/kernel" in notes[0], notes
    preds = np.stack(
        [p["logits"] for p in est.predict(h.eval_input_fn(X), checkpoint_path=str(model_dir))]
    )
    np.testing.assert_allclose(preds, _numpy_logits(values, X), rtol=1e-5, atol=1e-5)


def test_training_resume_stays_strict(tmp_path, written):
    model_dir, _ = written
    est = h.make_estimator(model_dir, reader_model_fn, params={"var_list": None})
    with pytest.raises(estimator.CheckpointMismatchError, match="shadow_hidden/kernel"):
        est.train(h.train_input_fn(X, Y), max_steps=6)


def test_a_mapping_to_a_missing_name_says_which(tmp_path, written):
    model_dir, _ = written
    est = _reader(tmp_path, {"ema/hidden/kernel": "hidden/kernel"})
    with pytest.raises(estimator.CheckpointMismatchError, match="ema/hidden/kernel"):
        est.evaluate(h.eval_input_fn(X, Y), checkpoint_path=str(model_dir))
    est = _reader(tmp_path / "b", {"shadow_hidden/kernel": "hiddn/kernel"})
    with pytest.raises(estimator.CheckpointMismatchError, match="hiddn/kernel"):
        est.evaluate(h.eval_input_fn(X, Y), checkpoint_path=str(model_dir))


def test_saver_forms():
    saver = estimator.Saver({"a/ExponentialMovingAverage:0": "a:0"})
    assert saver.sources == {"a": "a/ExponentialMovingAverage"}
    assert estimator.Saver(["x", "y"]).sources == {"x": "x", "y": "y"}
    assert estimator.Saver().sources is None
    with pytest.raises(TypeError, match="var_list"):
        estimator.Saver(42)
    with pytest.raises(ValueError, match="twice"):
        estimator.Saver({"a": "x", "b": "x"})
    with pytest.raises(TypeError, match="saver"):
        estimator.Scaffold(saver="not a saver")
    with pytest.raises(RuntimeError, match="writes every checkpoint"):
        saver.save(None, "/tmp/x")


def test_tf_saver_arguments_warn_once(caplog):
    with caplog.at_level(logging.WARNING, logger="estimator"):
        estimator.Saver(None, max_to_keep=3, sharded=True)
        estimator.Saver(None, max_to_keep=3)
    notes = [r.getMessage() for r in caplog.records if "Saver(" in r.getMessage()]
    assert sum("max_to_keep" in n for n in notes) <= 1 and sum("sharded" in n for n in notes) <= 1
    with pytest.raises(TypeError, match="unexpected"):
        estimator.Saver(None, max_to_kep=3)
