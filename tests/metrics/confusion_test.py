"""Tests for metrics/_confusion.py: TP/FP/TN/FN, precision, recall against scikit-learn."""

import numpy as np
import pytest
from sklearn import metrics as skm

import metrics

RNG = np.random.default_rng(3)
N = 400

COUNTS = [
    ("tp", metrics.true_positives),
    ("fp", metrics.false_positives),
    ("tn", metrics.true_negatives),
    ("fn", metrics.false_negatives),
]


def _data(weighted):
    labels = RNG.integers(0, 2, N)
    scores = np.clip(0.3 * labels + RNG.uniform(0, 0.7, N), 0, 1)
    weights = RNG.integers(0, 4, N).astype(float) if weighted else None
    return labels, scores, weights


def _sklearn_counts(labels, predicted, weights):
    tn, fp, fn, tp = skm.confusion_matrix(
        labels, predicted, labels=[0, 1], sample_weight=weights
    ).ravel()
    return {"tp": tp, "fp": fp, "tn": tn, "fn": fn}


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("name, factory", COUNTS, ids=[c[0] for c in COUNTS])
def test_counts_match_sklearn_confusion_matrix(name, factory, weighted):
    labels, scores, weights = _data(weighted)
    expected = _sklearn_counts(labels, scores > 0.5, weights)[name]
    value = factory(labels, scores, weights).compute()
    assert type(value) is float
    assert value == expected  # integer weights: exact


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize(
    "factory, reference",
    [(metrics.precision, skm.precision_score), (metrics.recall, skm.recall_score)],
    ids=["precision", "recall"],
)
def test_precision_recall_match_sklearn(factory, reference, weighted):
    labels, scores, weights = _data(weighted)
    expected = reference(labels, scores > 0.5, sample_weight=weights, zero_division=0)
    assert factory(labels, scores, weights).compute() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("thresholds", [[0.2, 0.5, 0.8], [0.9, 0.1, 0.5, 0.5]])
def test_list_of_thresholds_gives_one_value_each(thresholds):
    labels, scores, weights = _data(True)
    for name, factory in COUNTS:
        values = factory(labels, scores, weights, thresholds=thresholds).compute()
        expected = [_sklearn_counts(labels, scores > t, weights)[name] for t in thresholds]
        np.testing.assert_array_equal(values, expected)
    precisions = metrics.precision(labels, scores, weights, thresholds=thresholds).compute()
    expected = [
        skm.precision_score(labels, scores > t, sample_weight=weights, zero_division=0)
        for t in thresholds
    ]
    np.testing.assert_allclose(precisions, expected, rtol=1e-12)


def test_scalar_threshold_gives_float():
    value = metrics.recall([1, 1], [0.3, 0.7], thresholds=0.25).compute()
    assert value == 1.0 and type(value) is float


@pytest.mark.parametrize(
    "labels, predictions, expected",
    [
        ([True, False, True], [True, True, False], 0.5),  # booleans
        ([1, 0, 1], [1, 1, 0], 0.5),  # 0/1 ints: same as TF's cast to bool
        ([2, 0, 5], [0.51, 0.6, 0.5], 0.5),  # labels cast to bool; 0.5 itself is negative
    ],
)
def test_precision_input_kinds(labels, predictions, expected):
    assert metrics.precision(labels, predictions).compute() == expected


def test_division_by_zero_is_zero():
    assert metrics.precision([1, 1], [0.1, 0.2]).compute() == 0.0  # nothing predicted positive
    assert metrics.recall([0, 0], [0.9, 0.2]).compute() == 0.0  # no positive labels
    np.testing.assert_array_equal(
        metrics.precision([], [], thresholds=[0.1, 0.2]).compute(), [0.0, 0.0]
    )


def test_nan_prediction_is_negative_and_masked_rows_ignored():
    assert metrics.false_negatives([1], [np.nan]).compute() == 1.0
    assert metrics.true_positives([1, 1], [np.nan, 0.9], mask=[0, 1]).compute() == 1.0


def test_multidimensional_inputs_with_row_weights():
    labels = RNG.integers(0, 2, size=(20, 3))
    scores = RNG.uniform(size=(20, 3))
    weights = RNG.integers(0, 3, size=20).astype(float)
    full = np.repeat(weights[:, None], 3, axis=1)
    expected = skm.recall_score(
        labels.reshape(-1), scores.reshape(-1) > 0.5, sample_weight=full.reshape(-1)
    )
    assert metrics.recall(labels, scores, weights).compute() == pytest.approx(expected)
