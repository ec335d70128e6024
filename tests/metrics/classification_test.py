"""Tests for metrics/_classification.py against scikit-learn."""

import numpy as np
import pytest
from sklearn import metrics as skm

import metrics

RNG = np.random.default_rng(2)
N, C = 300, 5


def _weights(kind, n=N):
    if kind == "none":
        return None
    if kind == "integer":
        return RNG.integers(0, 4, size=n).astype(float)
    return RNG.uniform(0, 2, size=n) * (RNG.uniform(size=n) > 0.1)


WEIGHTS = ["none", "integer", "float"]


@pytest.mark.parametrize("weights", WEIGHTS)
def test_accuracy_matches_sklearn(weights):
    labels = RNG.integers(0, C, N)
    predictions = np.where(RNG.uniform(size=N) < 0.6, labels, RNG.integers(0, C, N))
    w = _weights(weights)
    expected = skm.accuracy_score(labels, predictions, sample_weight=w)
    assert metrics.accuracy(labels, predictions, w).compute() == pytest.approx(expected)


def test_accuracy_is_elementwise_over_any_shape():
    labels = RNG.integers(0, 2, size=(10, 4))
    predictions = RNG.integers(0, 2, size=(10, 4))
    row_weights = RNG.integers(0, 3, size=10)
    expected = np.average(labels == predictions, weights=np.repeat(row_weights[:, None], 4, 1))
    assert metrics.accuracy(labels, predictions, row_weights).compute() == pytest.approx(expected)


def test_accuracy_of_float_and_bool_labels():
    assert metrics.accuracy([1.0, 0.0], [True, True]).compute() == 0.5


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("all_classes_present", [True, False], ids=["all", "missing"])
def test_mean_per_class_accuracy_matches_sklearn_recall(weights, all_classes_present):
    high = C if all_classes_present else C - 2  # TF averages over every class, even absent ones
    labels = RNG.integers(0, high, N)
    predictions = np.where(RNG.uniform(size=N) < 0.5, labels, RNG.integers(0, C, N))
    w = _weights(weights)
    per_class = skm.recall_score(
        labels, predictions, labels=range(C), average=None, sample_weight=w, zero_division=0
    )
    m = metrics.mean_per_class_accuracy(labels, predictions, C, w)
    np.testing.assert_allclose(m.per_class(), per_class, rtol=1e-12)
    assert m.compute() == pytest.approx(per_class.mean())
    if all_classes_present:
        expected = skm.balanced_accuracy_score(labels, predictions, sample_weight=w)
        assert m.compute() == pytest.approx(expected)


def test_mean_per_class_accuracy_counts_out_of_range_predictions_as_wrong():
    m = metrics.mean_per_class_accuracy([0, 1], [0, 7], num_classes=2)
    assert m.compute() == 0.5


def _reference_mean_iou(labels, predictions, w):
    per_class = skm.jaccard_score(
        labels, predictions, labels=range(C), average=None, sample_weight=w, zero_division=0
    )
    weight = np.ones(N) if w is None else w
    present = np.zeros(C, bool)
    present[labels[weight != 0]] = True
    present[predictions[weight != 0]] = True
    return per_class, per_class[present].mean()


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("all_classes_present", [True, False], ids=["all", "missing"])
def test_mean_iou_matches_sklearn_jaccard(weights, all_classes_present):
    high = C if all_classes_present else C - 2  # absent classes are left out of the mean
    labels = RNG.integers(0, high, N)
    predictions = np.where(RNG.uniform(size=N) < 0.5, labels, RNG.integers(0, high, N))
    w = _weights(weights)
    per_class, expected = _reference_mean_iou(labels, predictions, w)
    m = metrics.mean_iou(labels, predictions, C, w)
    np.testing.assert_allclose(m.per_class(), per_class, rtol=1e-12)
    assert m.compute() == pytest.approx(expected)
    cm = skm.confusion_matrix(labels, predictions, labels=range(C), sample_weight=w)
    np.testing.assert_allclose(m.confusion, cm)


def test_mean_iou_flattens_any_rank():
    labels = RNG.integers(0, 3, size=(4, 6, 6))
    predictions = RNG.integers(0, 3, size=(4, 6, 6))
    flat = metrics.mean_iou(labels.reshape(-1), predictions.reshape(-1), 3).compute()
    assert metrics.mean_iou(labels, predictions, 3).compute() == flat


@pytest.mark.parametrize(
    "factory", [metrics.mean_per_class_accuracy, metrics.mean_iou], ids=["mpca", "iou"]
)
def test_zero_weight_rows_are_not_range_checked(factory):
    m = factory([0, 99, 1], [0, 99, 1], 2, weights=[1, 0, 1])
    assert m.compute() == 1.0
    m = factory([0, -1, 1], [0, 0, 1], 2, mask=[True, False, True])
    assert m.compute() == 1.0


def test_mean_iou_weighted_by_hand():
    m = metrics.mean_iou([0, 0, 1, 1], [0, 1, 1, 1], 2, weights=[1, 1, 1, 0])
    # confusion [[1, 1], [0, 1]]: IoU0 = 1 / (2 + 1 - 1), IoU1 = 1 / (1 + 2 - 1)
    np.testing.assert_allclose(m.confusion, [[1, 1], [0, 1]])
    assert m.compute() == pytest.approx(0.5)


def test_mean_iou_skips_classes_absent_from_labels_and_predictions():
    m = metrics.mean_iou([0, 1], [0, 1], num_classes=4)
    np.testing.assert_allclose(m.per_class(), [1, 1, 0, 0])
    assert m.compute() == 1.0
