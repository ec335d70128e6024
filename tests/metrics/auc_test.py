"""Tests for metrics/_auc.py: TF's thresholded AUC, exactly and against sklearn loosely."""

import math

import numpy as np
import pytest
from sklearn import metrics as skm

import metrics

RNG = np.random.default_rng(4)


def _reference_auc(labels, scores, weights, num_thresholds, curve, summation_method):
    """A direct, unoptimised transcription of tf.compat.v1.metrics.auc."""
    thresholds = [(i + 1) * 1.0 / (num_thresholds - 1) for i in range(num_thresholds - 2)]
    thresholds = np.array([-1e-7, *thresholds, 1.0 + 1e-7])
    w = np.ones(len(labels)) if weights is None else np.asarray(weights, float)
    is_pos = np.asarray(labels).astype(bool)
    tp, fp, tn, fn = (np.zeros(num_thresholds) for _ in range(4))
    for i, t in enumerate(thresholds):
        above = scores > t
        tp[i] = np.sum(w * (is_pos & above))
        fp[i] = np.sum(w * (~is_pos & above))
        tn[i] = np.sum(w * (~is_pos & ~above))
        fn[i] = np.sum(w * (is_pos & ~above))
    eps = 1e-6
    total = 0.0
    if curve == "PR" and summation_method == "careful_interpolation":
        for i in range(num_thresholds - 1):
            dtp = tp[i] - tp[i + 1]
            p_a, p_b = tp[i] + fp[i], tp[i + 1] + fp[i + 1]
            slope = dtp / max(p_a - p_b, 0) if max(p_a - p_b, 0) != 0 else 0.0
            intercept = tp[i + 1] - slope * p_b
            ratio = p_a / p_b if (p_a > 0 and p_b > 0) else 1.0
            denominator = max(tp[i + 1] + fn[i + 1], 0)
            numerator = slope * (dtp + intercept * math.log(ratio))
            total += numerator / denominator if denominator != 0 else 0.0
        return total
    recall = (tp + eps) / (tp + fn + eps)
    if curve == "ROC":
        x, y = fp / (fp + tn + eps), recall
    else:
        x, y = recall, (tp + eps) / (tp + fp + eps)
    for i in range(num_thresholds - 1):
        height = {
            "minoring": min(y[i], y[i + 1]),
            "majoring": max(y[i], y[i + 1]),
        }.get(summation_method, (y[i] + y[i + 1]) / 2)
        total += (x[i] - x[i + 1]) * height
    return total


def _data(n=500, weighted=True):
    labels = RNG.integers(0, 2, n)
    scores = np.clip(0.35 * labels + RNG.normal(0.35, 0.2, n), 0, 1)
    weights = RNG.uniform(0, 2, n) * (RNG.uniform(size=n) > 0.1) if weighted else None
    return labels, scores, weights


OPTIONS = [
    ("ROC", "trapezoidal"),
    ("ROC", "careful_interpolation"),
    ("ROC", "minoring"),
    ("ROC", "majoring"),
    ("PR", "trapezoidal"),
    ("PR", "careful_interpolation"),
    ("PR", "minoring"),
    ("PR", "majoring"),
]


@pytest.mark.parametrize("curve, summation_method", OPTIONS)
@pytest.mark.parametrize("num_thresholds", [2, 7, 200])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_matches_tf_algorithm(curve, summation_method, num_thresholds, weighted):
    labels, scores, weights = _data(weighted=weighted)
    expected = _reference_auc(labels, scores, weights, num_thresholds, curve, summation_method)
    m = metrics.auc(
        labels,
        scores,
        weights,
        num_thresholds,
        curve=curve,
        summation_method=summation_method,
    )
    assert m.compute() == pytest.approx(expected, rel=1e-9, abs=1e-12)


# Expected values from TensorFlow's own tests of tf.compat.v1.metrics.auc.
TF_CASES = [
    ([1, 0, 1, 0], [0, 1, 1, 0], None, {}, 0.5),
    ([1, 0, 1, 0], [0, 1, 1, 0], [2], {}, 0.5),
    ([1, 0, 1, 0], [0, 1, 1, 0], [1, 2, 3, 4], {}, 0.7),
    ([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], None, {"curve": "PR"}, 0.79166),
    (
        [0.1, 0.4, 0.35, 0.8, 0.1, 0.135, 0.81],
        [0, 0, 1, 0, 1, 0, 1],
        None,
        {"curve": "PR"},
        0.610317,
    ),
    ([0.0, 0.1, 0.2, 0.33, 0.3, 0.4, 0.5], [0, 0, 0, 0, 1, 1, 1], None, {"curve": "PR"}, 0.90277),
    (
        [0.1, 0.4, 0.35, 0.8],
        [0, 0, 1, 1],
        None,
        {"curve": "PR", "summation_method": "careful_interpolation"},
        1 - math.log(1.5) / 2,
    ),
    (
        [0.1, 0.4, 0.35, 0.8, 0.1, 0.135, 0.81],
        [0, 0, 1, 0, 1, 0, 1],
        None,
        {"curve": "PR", "summation_method": "careful_interpolation"},
        (2.5 - 2 * math.log(4.0 / 3) - 0.25 * math.log(7.0 / 5)) / 3,
    ),
    (
        [0.0, 0.1, 0.2, 0.33, 0.3, 0.4, 0.5],
        [0, 0, 0, 0, 1, 1, 1],
        None,
        {"curve": "PR", "summation_method": "careful_interpolation"},
        1 - math.log(4.0 / 3) / 3,
    ),
    ([0.12, 0.3001, 0.3003, 0.72], [0, 1, 0, 1], None, {}, 0.875),
    (
        [0.12, 0.3001, 0.3003, 0.72],
        [0, 1, 0, 1],
        None,
        {"thresholds": [0.0, 0.2, 0.3002, 0.6, 1.0]},
        0.75,
    ),
    ([0.0, 0.0, 0.0, 0.0], [0, 0, 0, 0], None, {}, 1.0),
    ([1.0, 1.0, 1.0, 1.0], [1, 1, 1, 1], None, {"curve": "PR"}, 1.0),
]


@pytest.mark.parametrize("predictions, labels, weights, options, expected", TF_CASES)
def test_tf_reference_values(predictions, labels, weights, options, expected):
    # TF's tests pass [1, 4]-shaped tensors; the (1, 1) weight broadcasts.
    predictions = np.array(predictions, np.float32).reshape(1, -1)
    labels = np.array(labels).reshape(1, -1)
    if weights is not None:
        weights = np.array(weights).reshape(1, -1)
    assert metrics.auc(labels, predictions, weights, **options).compute() == pytest.approx(
        expected, abs=1e-3
    )


@pytest.mark.parametrize("perfect", [True, False], ids=["all_correct", "all_wrong"])
def test_all_correct_and_all_incorrect(perfect):
    labels = RNG.integers(0, 2, 100)
    predictions = labels if perfect else 1 - labels
    value = metrics.auc(labels, predictions.astype(float)).compute()
    assert value == pytest.approx(1.0 if perfect else 0.0, abs=1e-6)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_close_to_sklearn_exact_auc(weighted):
    labels, scores, weights = _data(n=2000, weighted=weighted)
    roc = metrics.auc(labels, scores, weights).compute()
    assert roc == pytest.approx(skm.roc_auc_score(labels, scores, sample_weight=weights), abs=5e-3)
    pr = metrics.auc(
        labels, scores, weights, curve="PR", summation_method="careful_interpolation"
    ).compute()
    expected = skm.average_precision_score(labels, scores, sample_weight=weights)
    assert pr == pytest.approx(expected, abs=2e-2)


def test_more_thresholds_approach_sklearn():
    labels, scores, _ = _data(n=3000, weighted=False)
    exact = skm.roc_auc_score(labels, scores)
    errors = [abs(metrics.auc(labels, scores, None, n).compute() - exact) for n in (10, 200, 2000)]
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 1e-3


def test_no_examples_gives_zero():
    assert metrics.auc([], []).compute() == 0.0
    assert metrics.auc([1, 0], [0.2, 0.9], weights=[0, 0]).compute() == 0.0
    assert metrics.AUC.empty(curve="PR").compute() == 0.0


def test_out_of_range_prediction_with_zero_weight_is_ignored():
    value = metrics.auc([1, 0, 1], [0.9, 7.0, 0.8], weights=[1, 0, 1]).compute()
    assert value == metrics.auc([1, 1], [0.9, 0.8]).compute()
