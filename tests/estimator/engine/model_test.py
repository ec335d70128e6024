"""model_fn under the estimator's Flax root: BatchNorm in training mode during EVAL and
PREDICT (issue 41) normalises with the batch's statistics and leaves the moving averages as
trained, as TF did."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
import metrics
from tests import helpers as h

B = 16
EPS = 1e-5


def _mean_metric(y):
    return {"y_mean": metrics.mean(y.mean(-1))}


def _bn_model_fn(features, labels, mode, params):
    """DCGAN's discriminator pattern: batch norm called with is_training=True in every mode."""
    y = nn.BatchNorm(use_running_average=False, momentum=0.5, epsilon=EPS, axis_name="data")(
        features
    )
    logits = nn.Dense(3, name="out")(y)
    if mode == estimator.ModeKeys.PREDICT:
        return estimator.TPUEstimatorSpec(mode, predictions={"y": y})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(
        mode, loss=loss, train_op=optax.sgd(0.1), eval_metrics=(_mean_metric, [y])
    )


def _numpy_batch_norm(x, scale, bias):
    mean, var = x.mean(0), x.var(0)
    return (x - mean) / np.sqrt(var + EPS) * scale + bias


def _batches(x, y):
    def input_fn(params):
        b = params["batch_size"]
        for i in range(0, len(x), b):
            yield x[i : i + b], y[i : i + b]

    return input_fn


@pytest.mark.parametrize("use_tpu", [True, False], ids=["8 replicas", "one device"])
def test_training_mode_batch_norm_in_eval_and_predict_uses_batch_stats(tmp_path, use_tpu):
    x, y = h.make_data(n=4 * B)
    x = x * 3.0 + 1.0  # statistics far from the initial moving averages (0, 1)
    est = h.make_estimator(tmp_path, _bn_model_fn, ipl=2, use_tpu=use_tpu)
    est.train(h.train_input_fn(x, y, features_dict=False), max_steps=2)
    before = {n: est.get_variable_value(n) for n in est.get_variable_names()}
    moving_mean = before["batch_stats/BatchNorm_0/mean"]
    assert not np.allclose(moving_mean, 0.0)  # training moved them
    scale, bias = before["BatchNorm_0/scale"], before["BatchNorm_0/bias"]

    xe, ye = x[: 2 * B], y[: 2 * B]
    preds = np.stack([p["y"] for p in est.predict(_batches(xe, ye), yield_single_examples=True)])
    want = np.concatenate([_numpy_batch_norm(xe[i : i + B], scale, bias) for i in (0, B)])
    np.testing.assert_allclose(preds, want, rtol=1e-4, atol=1e-4)
    results = est.evaluate(_batches(xe, ye))
    np.testing.assert_allclose(results["y_mean"], want.mean(), atol=1e-4)
    # Nothing written back: the checkpoint's statistics (and everything else) are as trained.
    after = {n: est.get_variable_value(n) for n in est.get_variable_names()}
    assert sorted(after) == sorted(before)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    # ...and training on resumes from them: the step's statistics are the trained ones moved.
    est.train(h.train_input_fn(x, y, features_dict=False), max_steps=3)
    resumed = est.get_variable_value("batch_stats/BatchNorm_0/mean")
    np.testing.assert_allclose(
        resumed, 0.5 * moving_mean + 0.5 * x[2 * B : 3 * B].mean(0), rtol=1e-4
    )


def test_running_average_batch_norm_in_eval_still_reads_the_moving_averages(tmp_path):
    """The usual form (use_running_average=not training) is unchanged."""

    def model_fn(features, labels, mode, params):
        train = mode == estimator.ModeKeys.TRAIN
        y = nn.BatchNorm(use_running_average=not train, momentum=0.5, epsilon=EPS)(features)
        if mode == estimator.ModeKeys.PREDICT:
            return estimator.TPUEstimatorSpec(mode, predictions={"y": y})
        loss = jnp.mean(nn.Dense(1)(y) ** 2)
        return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.0))

    x, y = h.make_data(n=4 * B)
    est = h.make_estimator(tmp_path, model_fn, ipl=2, use_tpu=False)
    est.train(h.train_input_fn(x, y, features_dict=False), max_steps=2)
    mean = est.get_variable_value("batch_stats/BatchNorm_0/mean")
    var = est.get_variable_value("batch_stats/BatchNorm_0/var")
    preds = np.stack([p["y"] for p in est.predict(_batches(x[:B], y[:B]))])
    np.testing.assert_allclose(preds, (x[:B] - mean) / np.sqrt(var + EPS), rtol=1e-4, atol=1e-4)
