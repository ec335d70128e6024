"""Tests for metrics/_ranking.py: recall_at_k against sklearn's top_k_accuracy_score."""

import numpy as np
import pytest
from sklearn import metrics as skm

import metrics

RNG = np.random.default_rng(5)
N, C = 300, 6


def _data(weighted):
    labels = RNG.integers(0, C, N)
    scores = RNG.normal(size=(N, C))
    scores[np.arange(N), labels] += 1.0
    weights = RNG.integers(0, 4, N).astype(float) if weighted else None
    return labels, scores, weights


@pytest.mark.filterwarnings("ignore:'k' .* greater than or equal to 'n_classes'")
@pytest.mark.parametrize("k", [1, 2, 5, C])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_matches_top_k_accuracy(k, weighted):
    labels, scores, weights = _data(weighted)
    expected = skm.top_k_accuracy_score(labels, scores, k=k, labels=range(C), sample_weight=weights)
    value = metrics.recall_at_k(labels, scores, k, weights=weights).compute()
    assert type(value) is float
    assert value == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("class_id", [0, 3])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_class_id_restricts_to_rows_of_that_class(class_id, weighted):
    labels, scores, weights = _data(weighted)
    rows = labels == class_id
    expected = skm.top_k_accuracy_score(
        labels[rows],
        scores[rows],
        k=2,
        labels=range(C),
        sample_weight=None if weights is None else weights[rows],
    )
    m = metrics.recall_at_k(labels, scores, 2, class_id, weights)
    assert m.compute() == pytest.approx(expected, rel=1e-12)


def test_ties_go_to_lower_class_index_like_tf_top_k():
    scores = np.array([[0.5, 0.5, 0.5]])
    assert metrics.recall_at_k([0], scores, k=1).compute() == 1.0
    assert metrics.recall_at_k([1], scores, k=1).compute() == 0.0
    assert metrics.recall_at_k([1], scores, k=2).compute() == 1.0
    assert metrics.recall_at_k([2], scores, k=2).compute() == 0.0


def test_out_of_range_labels_count_as_misses():
    scores = np.array([[0.1, 0.9], [0.9, 0.1]])
    assert metrics.recall_at_k([5, 0], scores, k=2).compute() == 0.5
    assert metrics.recall_at_k([-1, 0], scores, k=2).compute() == 0.5


def test_labels_with_trailing_unit_axis_and_leading_dims():
    labels, scores, _ = _data(False)
    expected = metrics.recall_at_k(labels, scores, 2).compute()
    assert metrics.recall_at_k(labels[:, None], scores, 2).compute() == expected
    reshaped = metrics.recall_at_k(labels.reshape(30, 10), scores.reshape(30, 10, C), 2)
    assert reshaped.compute() == expected


def test_no_relevant_rows_gives_zero():
    assert metrics.recall_at_k(np.zeros(0, int), np.zeros((0, 3)), 1).compute() == 0.0
    assert metrics.recall_at_k([0, 0], np.eye(2), 1, class_id=1).compute() == 0.0
