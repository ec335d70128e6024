"""The bad-input catalogue: each mistake a user can make gives a clear error naming the culprit.

Spec construction, RunConfig/TPUConfig and constructor errors are in ``spec_test.py``;
metric_fn mistakes in ``driver/evaluation_metrics_test.py``; per-batch shape/dtype/structure
changes during training in ``data/inputs_test.py``. This file covers the rest, end to end
through ``train``/``evaluate``/``predict``.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import types
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
import hooks
from estimator.io.checkpoint import CheckpointError, CheckpointMismatchError
from tests import helpers as h

B = 16
X, Y = h.make_data()
GOOD = [({"x": X[i : i + B]}, Y[i : i + B]) for i in range(0, len(X), B)]
FEATURES_ONLY = [f for f, _ in GOOD]
# Orbax's asyncio helpers print "Event loop is closed" after a failed read; that is noise.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _batches(items):
    return lambda params: iter(items)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A model_dir holding checkpoint 2 of ``helpers.model_fn`` (hidden 16, SGD)."""
    model_dir = tmp_path_factory.mktemp("trained")
    h.make_estimator(model_dir, ipl=2, keep_checkpoint_max=None).train(_batches(GOOD), max_steps=2)
    return model_dir


@pytest.fixture
def ctx(trained, tmp_path):
    copy = tmp_path / "trained_copy"
    shutil.copytree(trained, copy)
    return types.SimpleNamespace(fresh=tmp_path / "fresh", trained=copy)


# ----------------------------------------------------------------------------- model_fns
def _dense(features):
    return nn.Dense(3, name="out")(nn.relu(nn.Dense(16, name="hidden")(features["x"])))


def _needs_labels(features, labels, mode, params):
    loss = optax.softmax_cross_entropy_with_integer_labels(_dense(features), labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.1))


def _no_labels_arg(features, mode, params):
    return estimator.TPUEstimatorSpec(mode, loss=_dense(features).mean(), train_op=optax.sgd(0.1))


def _wrong_mode(features, labels, mode, params):
    return estimator.TPUEstimatorSpec(estimator.ModeKeys.EVAL, loss=_dense(features).mean())


def _int_loss(features, labels, mode, params):
    return estimator.TPUEstimatorSpec(
        mode, loss=jnp.int32(_dense(features).shape[0]), train_op=optax.sgd(0.1)
    )


def _predicting(predictions_of):
    def model_fn(features, labels, mode, params):
        logits = _dense(features)
        if mode == estimator.ModeKeys.PREDICT:
            return estimator.TPUEstimatorSpec(mode, predictions=predictions_of(logits))
        return estimator.TPUEstimatorSpec(mode, loss=logits.mean(), train_op=optax.sgd(0.1))

    return model_fn


def _other_names(features, labels, mode, params):
    logits = nn.Dense(3, name="other")(features["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(
        mode, loss=loss, train_op=optax.sgd(0.1), predictions={"logits": logits}
    )


def _adam(features, labels, mode, params):
    logits = _dense(features)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.adam(1e-3))


class _NotJsonState:
    def __iter__(self):
        return self

    def __next__(self):
        return GOOD[0]

    def get_state(self):
        return {"file": object()}

    def set_state(self, state):
        raise AssertionError("not reached")


def _a_file(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "a_file").write_text("not a directory")
    return directory / "a_file"


# ----------------------------------------------------------------------------- the catalogue
def _train(fn=h.model_fn, batches=GOOD, **kw):
    return lambda c: h.make_estimator(c.fresh, fn, ipl=2, keep_checkpoint_max=None).train(
        _batches(batches), max_steps=4, **kw
    )


def _evaluate(batches=GOOD, fn=h.model_fn, **kw):
    return lambda c: h.make_estimator(c.trained, fn, ipl=2, keep_checkpoint_max=None).evaluate(
        _batches(batches), **kw
    )


def _predict(batches=FEATURES_ONLY, fn=h.model_fn, **kw):
    return lambda c: list(
        h.make_estimator(c.trained, fn, ipl=2, keep_checkpoint_max=None).predict(
            _batches(batches), **kw
        )
    )


def _train_input(input_fn):
    return lambda c: h.make_estimator(c.fresh, ipl=2, keep_checkpoint_max=None).train(
        input_fn, max_steps=4
    )


CASES = [
    # model_fn and what it returns
    (
        "model_fn not callable",
        lambda c: h.make_estimator(c.fresh, "model_fn", ipl=2, keep_checkpoint_max=None),
        TypeError,
        "model_fn must be callable",
    ),
    (
        "model_fn without features",
        lambda c: h.make_estimator(
            c.fresh, lambda labels, mode, params: None, ipl=2, keep_checkpoint_max=None
        ),
        ValueError,
        "'features'",
    ),
    (
        "spec for another mode",
        _train(_wrong_mode),
        ValueError,
        "called in mode 'train' but returned a spec for 'eval'",
    ),
    ("integer loss", _train(_int_loss), TypeError, "loss must be a floating-point.*int32"),
    (
        "predictions a list",
        _predict(fn=_predicting(lambda lg: [lg])),
        TypeError,
        "predictions must be an array or a dict",
    ),
    (
        "prediction without batch dimension",
        _predict(fn=_predicting(lambda lg: {"total": lg.sum(), "logits": lg})),
        ValueError,
        r"prediction \['total'\] has shape \(\)",
    ),
    (
        "prediction with wrong batch dimension",
        _predict(fn=_predicting(lambda lg: {"first": lg[:1], "logits": lg})),
        ValueError,
        r"prediction \['first'\] has shape \(1, 3\).*leading batch dimension of 2",
    ),
    # labels
    (
        "labels missing in train",
        _train(_needs_labels, FEATURES_ONLY),
        ValueError,
        "labels=None.*input_fn returned features only",
    ),
    (
        "labels missing in evaluate",
        _evaluate(FEATURES_ONLY, _needs_labels),
        ValueError,
        "mode 'eval' with labels=None",
    ),
    (
        "labels given, model_fn takes none",
        _train(_no_labels_arg),
        ValueError,
        "does not take a 'labels' argument",
    ),
    # input_fn
    ("input_fn not callable", _train_input(GOOD), TypeError, "input_fn must be callable"),
    (
        "input_fn without params",
        _train_input(lambda: iter(GOOD)),
        ValueError,
        "input_fn must take a 'params' argument",
    ),
    (
        "input_fn with an unknown argument",
        _train_input(lambda params, shuffle: iter(GOOD)),
        ValueError,
        r"unexpected argument\(s\) \['shuffle'\]",
    ),
    ("input_fn returns None", _train_input(lambda params: None), TypeError, "returned None"),
    (
        "input_fn returns a number",
        _train_input(lambda params: 3),
        TypeError,
        "iterable of batches, got int",
    ),
    (
        "input_fn returns a dict of whole arrays",
        _train_input(lambda params: {"x": X, "y": Y}),
        TypeError,
        "yielded 'x', not a batch",
    ),
    ("empty input in train", _train(batches=[]), ValueError, "no training batches"),
    ("empty input in evaluate", _evaluate([]), ValueError, "no batches to evaluate"),
    ("empty input in predict", _predict([]), ValueError, "no batches to predict"),
    (
        "first batch smaller than batch_size",
        _train(batches=[({"x": X[:8]}, Y[:8])] * 4),
        ValueError,
        r"first training batch has 8 rows, expected params\['batch_size'\] = 16",
    ),
    (
        "batch shape changes in evaluate",
        _evaluate([GOOD[0], ({"x": np.zeros((B, 7), np.float32)}, Y[:B])]),
        ValueError,
        r"entry \[0\]\['x'\] has shape \(16, 7\)",
    ),
    (
        "feature with a scalar entry",
        _train(batches=[({"x": X[:B], "w": 0.5}, Y[:B])]),
        ValueError,
        r"\['w'\] is a scalar",
    ),
    (
        "string feature",
        _train(batches=[({"x": X[:B], "id": np.array(["a"] * B)}, Y[:B])]),
        TypeError,
        r"\['id'\] has dtype <U1",
    ),
    (
        "get_state not JSON",
        _train_input(lambda params: _NotJsonState()),
        TypeError,
        "get_state.*cannot be saved in a checkpoint",
    ),
    # train / evaluate / predict arguments
    (
        "hook of the wrong type in train",
        _train(hooks=["log"]),
        TypeError,
        "SessionRunHook instances, given: 'log'",
    ),
    (
        "hook of the wrong type in evaluate",
        _evaluate(hooks=[print]),
        TypeError,
        "SessionRunHook instances",
    ),
    (
        "hook of the wrong type in predict",
        _predict(hooks=[3]),
        TypeError,
        "SessionRunHook instances, given: 3",
    ),
    (
        "a single hook, not a list",
        _train(hooks=hooks.StopAtStepHook(num_steps=1)),
        TypeError,
        r"single StopAtStepHook; pass \[hook\]",
    ),
    (
        "steps as a string",
        lambda c: h.make_estimator(c.fresh, ipl=2, keep_checkpoint_max=None).train(
            _batches(GOOD), steps="10"
        ),
        TypeError,
        "steps must be an int",
    ),
    ("evaluate steps=0", _evaluate(steps=0), ValueError, "steps > 0"),
    (
        "params not a dict",
        lambda c: h.make_estimator(c.fresh, params=["lr", 0.1], ipl=2, keep_checkpoint_max=None),
        TypeError,
        "params must be a dict",
    ),
    (
        "predict_keys of the wrong type",
        _predict(predict_keys=3),
        TypeError,
        "predict_keys must be a str or a list of str",
    ),
    (
        "predict_keys with array predictions",
        _predict(fn=_predicting(lambda lg: lg), predict_keys=["logits"]),
        ValueError,
        "predict_keys can only be used when predictions is a dict",
    ),
    (
        "predict without predict_batch_size",
        lambda c: list(
            estimator.TPUEstimator(
                h.model_fn, config=h.config(c.trained), train_batch_size=B
            ).predict(_batches(FEATURES_ONLY))
        ),
        ValueError,
        "predict_batch_size must be set",
    ),
    # checkpoints
    (
        "evaluate without a checkpoint",
        lambda c: h.make_estimator(c.fresh, ipl=2, keep_checkpoint_max=None).evaluate(
            _batches(GOOD)
        ),
        ValueError,
        "Could not find trained model",
    ),
    (
        "predict without a checkpoint",
        lambda c: list(
            h.make_estimator(c.fresh, ipl=2, keep_checkpoint_max=None).predict(
                _batches(FEATURES_ONLY)
            )
        ),
        ValueError,
        "Could not find trained model",
    ),
    (
        "checkpoint_path step that does not exist",
        lambda c: h.make_estimator(c.trained, ipl=2, keep_checkpoint_max=None).evaluate(
            _batches(GOOD), checkpoint_path=str(c.trained / "model.ckpt-99")
        ),
        ValueError,
        "model.ckpt-99' does not exist",
    ),
    (
        "checkpoint_path that is not a checkpoint",
        lambda c: h.make_estimator(c.trained, ipl=2, keep_checkpoint_max=None).evaluate(
            _batches(GOOD), checkpoint_path=str(c.fresh)
        ),
        ValueError,
        "is not a checkpoint",
    ),
    (
        "get_variable_value of an unknown name",
        lambda c: h.make_estimator(c.trained, ipl=2, keep_checkpoint_max=None).get_variable_value(
            "hiden/kernel"
        ),
        ValueError,
        r"'hiden/kernel' not found.*similar: \['hidden/kernel'",
    ),
    (
        "warm_start_from a missing path",
        lambda c: h.make_estimator(
            c.fresh, warm_start_from=str(c.fresh / "nowhere"), ipl=2, keep_checkpoint_max=None
        ).train(_batches(GOOD), max_steps=2),
        ValueError,
        "nowhere",
    ),
    (
        "model_dir is a file",
        lambda c: h.make_estimator(_a_file(c.fresh), ipl=2, keep_checkpoint_max=None).train(
            _batches(GOOD), max_steps=2
        ),
        NotADirectoryError,
        "model_dir is not a directory: .*a_file",
    ),
]


@pytest.mark.parametrize("action,error,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_error(ctx, action, error, match):
    with pytest.raises(error, match=match):
        action(ctx)


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


MISMATCHES = [
    (
        "other layer sizes",
        "train",
        lambda: (h.model_fn, {"hidden": 32}),
        r"hidden/kernel: checkpoint shape \(6, 16\), model shape \(6, 32\)",
    ),
    (
        "other variable names",
        "evaluate",
        lambda: (_other_names, {}),
        r"other/kernel: in the model \(6, 3\), not in the checkpoint",
    ),
    (
        "an extra collection",
        "predict",
        lambda: (h.model_fn, {"batch_norm": True}),
        "batch_stats/BatchNorm_0/mean: in the model",
    ),
    ("another optimizer", "train", lambda: (_adam, {}), "train/opt_state/0/count: in the model"),
]


@pytest.mark.parametrize(
    "call,make,match", [m[1:] for m in MISMATCHES], ids=[m[0] for m in MISMATCHES]
)
def test_unrelated_checkpoint_in_model_dir_names_the_mismatch(ctx, call, make, match):
    fn, params = make()
    est = h.make_estimator(ctx.trained, fn, params=params, ipl=2, keep_checkpoint_max=None)
    before = _snapshot(ctx.trained)
    with pytest.raises(CheckpointMismatchError, match=match) as info:
        if call == "train":
            est.train(_batches(GOOD), max_steps=4)
        elif call == "evaluate":
            est.evaluate(_batches(GOOD))
        else:
            list(est.predict(_batches(FEATURES_ONLY)))
    assert "model.ckpt-2 does not match the model" in str(info.value)
    assert isinstance(info.value, ValueError)  # also catchable as a ValueError
    assert _snapshot(ctx.trained) == before  # no fallback, no fresh start, nothing written


def test_explicit_checkpoint_path_to_a_damaged_step_is_an_error_not_a_fallback(ctx):
    manifest = ctx.trained / "model.ckpt-2" / "variables" / "manifest.ocdbt"
    manifest.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="model.ckpt-2"):
        h.make_estimator(ctx.trained, ipl=2, keep_checkpoint_max=None).evaluate(
            _batches(GOOD), checkpoint_path=str(ctx.trained / "model.ckpt-2")
        )


def test_max_steps_below_the_current_step_is_a_logged_no_op(ctx, caplog):
    before = _snapshot(ctx.trained)

    def input_fn(params):
        raise AssertionError("input_fn must not be called")

    est = h.make_estimator(ctx.trained, ipl=2, keep_checkpoint_max=None)
    with caplog.at_level(logging.INFO, logger="estimator"):
        assert est.train(input_fn, max_steps=1) is est
    assert "Skipping training since max_steps has already saved (step 2; max_steps 1)" in (
        caplog.text
    )
    assert _snapshot(ctx.trained) == before
    assert est.get_variable_value("global_step") == 2
