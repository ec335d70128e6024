"""eval_metrics: metric_fn per eval batch on real rows only; results against sklearn/numpy."""

import types

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn import metrics as skm

import estimator
import metrics
from tests import helpers as h

BATCH, N = 16, 100  # 100 = 6 full batches of 16 + one of 4; loops of 4 batches


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint (helpers.model_fn) the estimators below evaluate; and its predictions."""
    model_dir = tmp_path_factory.mktemp("trained")
    x, y = h.make_data(n=N, seed=3)
    est = h.make_estimator(model_dir, h.model_fn)
    est.train(h.train_input_fn(x, y), max_steps=4)
    logits = np.stack([p["logits"] for p in est.predict(h.eval_input_fn(x))])
    assert logits.shape == (N, 3)
    return model_dir, x, y, logits


def _with_metrics(metric_fn, tensors_fn, *, estimator_spec=False):
    """helpers.model_fn's network, with ``eval_metrics=(metric_fn, tensors_fn(...))`` in EVAL."""

    def model_fn(features, labels, mode, params):
        if mode != estimator.ModeKeys.EVAL:
            return h.model_fn(features, labels, mode, params)
        # the same layers as helpers.model_fn, so its checkpoint fits
        logits = nn.Dense(3, name="out")(nn.relu(nn.Dense(16, name="hidden")(features["x"])))
        mask = estimator.padding_mask()
        per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        loss = (per_row * mask).sum() / jnp.maximum(mask.sum(), 1.0)
        tensors = tensors_fn(features, labels, logits)
        spec = estimator.TPUEstimatorSpec(mode, loss=loss, eval_metrics=(metric_fn, tensors))
        return spec.as_estimator_spec() if estimator_spec else spec

    return model_fn


def _row_recorder(calls: list, **kw):
    def metric_fn(row, labels):
        calls.append(row.copy())
        return {"rows_seen": metrics.mean(np.ones_like(row, np.float32))}

    return _with_metrics(metric_fn, lambda f, labels, logits: [f["row"], labels], **kw)


@pytest.mark.parametrize(
    "pipeline, use_tpu",
    [
        (estimator.InputPipelineConfig.PER_HOST_V1, True),
        (estimator.InputPipelineConfig.PER_HOST_V2, True),
        (estimator.InputPipelineConfig.BROADCAST, True),
        (estimator.InputPipelineConfig.PER_HOST_V1, False),
    ],
    ids=["per_host_v1", "per_host_v2", "broadcast", "one-device"],
)
def test_padded_rows_never_reach_metric_fn(trained, pipeline, use_tpu):
    model_dir, x, y, _ = trained
    calls = []
    # one device: the model_fn returns as_estimator_spec(), TF's single-device path
    recorder = _row_recorder(calls, estimator_spec=not use_tpu)
    est = h.make_estimator(
        model_dir,
        recorder,
        use_tpu=use_tpu,
        tpu={} if pipeline is None else {"per_host_input_for_training": pipeline},
    )
    est.evaluate(h.eval_input_fn(x, y, with_row=True))
    # once per eval batch, in input order, each real row exactly once
    assert [len(c) for c in calls] == [16] * 6 + [4]
    np.testing.assert_array_equal(np.concatenate(calls), np.arange(N))


def test_evaluate_steps_limits_the_batches(trained):
    model_dir, x, y, _ = trained
    calls = []
    h.make_estimator(model_dir, _row_recorder(calls)).evaluate(
        h.eval_input_fn(x, y, with_row=True), steps=2
    )
    np.testing.assert_array_equal(np.concatenate(calls), np.arange(32))


def _softmax(logits):
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _library_metric_fn(labels, logits):
    probs = _softmax(logits)
    positive = labels == 0  # a binary task: class 0 or not
    return {
        "accuracy": metrics.accuracy(labels, logits.argmax(-1)),
        "mean_per_class_accuracy": metrics.mean_per_class_accuracy(
            labels, logits.argmax(-1), num_classes=3
        ),
        "precision": metrics.precision(positive, probs[:, 0]),
        "recall": metrics.recall(positive, probs[:, 0]),
        "auc": metrics.auc(positive, probs[:, 0], num_thresholds=2000),
        "mse": metrics.mean_squared_error(np.eye(3)[labels], probs),
    }


def test_results_match_sklearn_on_the_same_predictions(trained):
    model_dir, x, y, logits = trained
    est = h.make_estimator(model_dir, _with_metrics(_library_metric_fn, lambda f, lb, lg: [lb, lg]))
    results = est.evaluate(h.eval_input_fn(x, y))

    probs = _softmax(logits.astype(np.float64))
    pred = logits.argmax(-1)
    positive = y == 0
    assert results["accuracy"] == pytest.approx(skm.accuracy_score(y, pred))
    assert results["mean_per_class_accuracy"] == pytest.approx(skm.balanced_accuracy_score(y, pred))
    assert results["precision"] == pytest.approx(skm.precision_score(positive, probs[:, 0] > 0.5))
    assert results["recall"] == pytest.approx(skm.recall_score(positive, probs[:, 0] > 0.5))
    assert results["auc"] == pytest.approx(skm.roc_auc_score(positive, probs[:, 0]), abs=5e-3)
    assert results["mse"] == pytest.approx(skm.mean_squared_error(np.eye(3)[y], probs), rel=1e-5)
    # loss: mean over the 100 real examples (padding excluded) of the per-row loss
    log_probs = np.log(probs)
    assert results["loss"] == pytest.approx(-log_probs[np.arange(N), y].mean(), rel=1e-4)
    assert results["global_step"] == 4


def test_plain_scalars_are_averaged_over_examples(trained):
    model_dir, x, y, _ = trained

    def metric_fn(row):
        return {"row_mean": row.mean(), "batch_median": float(np.median(row))}

    est = h.make_estimator(model_dir, _with_metrics(metric_fn, lambda f, lb, lg: [f["row"]]))
    results = est.evaluate(h.eval_input_fn(x, y, with_row=True))
    # example-weighted: the mean of all rows, not the mean of the 7 batch means
    assert results["row_mean"] == pytest.approx(np.arange(N).mean())
    batches = [np.arange(N)[i : i + BATCH] for i in range(0, N, BATCH)]
    sizes = np.array([len(b) for b in batches])
    medians = np.array([np.median(b) for b in batches])
    assert results["batch_median"] == pytest.approx((medians * sizes).sum() / sizes.sum())
    assert results["batch_median"] != pytest.approx(medians.mean())


@pytest.mark.parametrize(
    "metric_fn, error, match",
    [
        (lambda labels: {"loss": metrics.mean(labels)}, ValueError, "reserved metric name 'loss'"),
        (lambda labels: {"acc": (1.0, None)}, TypeError, r"'acc' as a \(value, update_op\)"),
        (lambda labels: {"per_row": labels}, TypeError, r"'per_row' of shape \(16,\)"),
        (lambda labels: [labels], TypeError, "must return a dict"),
    ],
    ids=["reserved", "tf-pair", "array", "not-a-dict"],
)
def test_metric_fn_mistakes_are_clear_errors(trained, metric_fn, error, match):
    model_dir, x, y, _ = trained
    est = h.make_estimator(model_dir, _with_metrics(metric_fn, lambda f, lb, lg: [lb]))
    with pytest.raises(error, match=match):
        est.evaluate(h.eval_input_fn(x, y))


def test_metric_fn_capturing_a_traced_value_is_a_clear_error(trained):
    model_dir, x, y, _ = trained

    box = types.SimpleNamespace()  # an object the closure check does not look into

    def tensors_fn(features, labels, logits):
        box.logits = logits  # the mistake under test: keep a traced value for the host
        return [labels]

    def metric_fn(labels):
        return {"accuracy": metrics.accuracy(labels, np.asarray(box.logits).argmax(-1))}

    est = h.make_estimator(model_dir, _with_metrics(metric_fn, tensors_fn))
    with pytest.raises(estimator.TracedValueError, match="metric_fn uses a value computed"):
        est.evaluate(h.eval_input_fn(x, y))

    def closure_model(features, labels, mode, params):
        spec = _with_metrics(lambda labels: {}, lambda f, lb, lg: [lb])(
            features, labels, mode, params
        )
        if mode != estimator.ModeKeys.EVAL:
            return spec
        traced = spec.loss

        def capturing(labels):
            return {"loss_seen": float(traced)}

        return estimator.TPUEstimatorSpec(mode, loss=traced, eval_metrics=(capturing, [labels]))

    with pytest.raises(estimator.TracedValueError, match="metric_fn captures 'traced'"):
        h.make_estimator(model_dir, closure_model).evaluate(h.eval_input_fn(x, y))
