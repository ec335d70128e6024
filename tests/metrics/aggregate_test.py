"""Tests for metrics/_aggregate.py: mean, Sum, as_metric, collecting."""

import numpy as np
import pytest

import metrics

RNG = np.random.default_rng(0)
VALUES = RNG.normal(size=(50, 3))
ROW_WEIGHTS = RNG.integers(0, 4, size=50).astype(float)
FULL_WEIGHTS = RNG.uniform(0, 2, size=(50, 3))


@pytest.mark.parametrize(
    "weights, expected_weights",
    [
        (None, np.ones((50, 3))),
        (2.5, np.full((50, 3), 2.5)),
        (ROW_WEIGHTS, np.repeat(ROW_WEIGHTS[:, None], 3, axis=1)),
        (ROW_WEIGHTS[:, None], np.repeat(ROW_WEIGHTS[:, None], 3, axis=1)),
        (FULL_WEIGHTS, FULL_WEIGHTS),
        (np.array([[1.0, 0.0, 2.0]]), np.tile([1.0, 0.0, 2.0], (50, 1))),
    ],
    ids=["none", "scalar", "per_row", "per_row_2d", "full", "per_column"],
)
def test_mean_and_sum_match_numpy(weights, expected_weights):
    expected_mean = np.average(VALUES, weights=expected_weights)
    assert metrics.mean(VALUES, weights).compute() == pytest.approx(expected_mean, rel=1e-12)
    expected_sum = np.sum(VALUES * expected_weights)
    total = metrics.Sum.from_model_output(VALUES, weights).compute()
    assert total == pytest.approx(expected_sum, rel=1e-12)


def test_mean_returns_python_float():
    assert type(metrics.mean(np.float32([1.0, 2.0])).compute()) is float


@pytest.mark.parametrize(
    "values, weights",
    [(np.zeros((0,)), None), (np.zeros((0, 3)), None), (np.ones(4), np.zeros(4))],
    ids=["no_rows", "no_rows_2d", "zero_weights"],
)
def test_mean_of_nothing_is_zero(values, weights):
    assert metrics.mean(values, weights).compute() == 0.0
    assert metrics.Sum.from_model_output(values, weights).compute() == 0.0


def test_zero_weight_excludes_nan_rows():
    values = np.array([1.0, np.nan, np.inf, 3.0])
    assert metrics.mean(values, [1, 0, 0, 1]).compute() == 2.0
    assert metrics.mean(values, mask=[True, False, False, True]).compute() == 2.0


def test_mask_combines_with_weights():
    m = metrics.mean([1.0, 2.0, 10.0], weights=[1.0, 3.0, 5.0], mask=[1, 1, 0])
    assert m.compute() == pytest.approx((1 + 6) / 4)


@pytest.mark.parametrize(
    "value, num_examples, expected_total",
    [(0.5, 4, 2.0), (np.float32(2.0), 3, 6.0), (np.array([1.5]), 2, 3.0), (np.nan, 0, 0.0)],
)
def test_as_metric_is_example_weighted_mean(value, num_examples, expected_total):
    m = metrics.as_metric(value, num_examples)
    assert isinstance(m, metrics.Mean)
    assert m.total == pytest.approx(expected_total)
    assert m.count == num_examples


def test_as_metric_merges_as_weighted_mean_and_with_mean():
    merged = metrics.as_metric(1.0, 1).merge(metrics.as_metric(0.0, 3))
    assert merged.compute() == 0.25
    assert merged.merge(metrics.mean([1.0, 1.0, 1.0, 1.0])).compute() == pytest.approx(5 / 8)


def test_as_metric_passes_metrics_through():
    m = metrics.accuracy([1], [1])
    assert metrics.as_metric(m, 10) is m


@pytest.mark.parametrize(
    "value, num_examples, error, match",
    [
        (np.ones(3), 3, ValueError, "`value`"),
        ("abc", 1, TypeError, "`value`"),
        (1.0, -1, ValueError, "`num_examples`"),
    ],
)
def test_as_metric_errors(value, num_examples, error, match):
    with pytest.raises(error, match=match):
        metrics.as_metric(value, num_examples)


def test_collecting_concatenates_in_merge_order_and_respects_mask():
    fn = lambda a, b: (a.copy(), b.copy())  # noqa: E731
    m = metrics.collecting(fn, np.array([1, 2]), np.array([[1.0], [2.0]]), mask=[1, 0])
    m = metrics.Collecting.empty(fn).merge(m)
    m = m.merge(metrics.collecting(fn, np.zeros(0), np.zeros((0, 1))))
    m = m.merge(metrics.collecting(fn, np.array([3]), np.array([[3.0]])))
    a, b = m.compute()
    np.testing.assert_array_equal(a, [1, 3])
    np.testing.assert_array_equal(b, [[1.0], [3.0]])


def test_collecting_merges_lambdas_recreated_per_batch():
    def batch(values):
        return metrics.collecting(lambda v: float(np.median(v)), values)

    assert batch(np.array([1.0, 9.0])).merge(batch(np.array([2.0]))).compute() == 2.0


def test_collecting_matches_exact_sklearn_auc():
    from sklearn.metrics import roc_auc_score

    labels, scores = RNG.integers(0, 2, 200), RNG.uniform(size=200)
    m = metrics.collecting(roc_auc_score, labels[:70], scores[:70])
    m = m.merge(metrics.collecting(roc_auc_score, labels[70:], scores[70:]))
    assert m.compute() == pytest.approx(roc_auc_score(labels, scores))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda: metrics.collecting(np.mean, np.ones(3), np.ones(2)),
            ValueError,
            "`arrays\\[1\\]`",
        ),
        (lambda: metrics.collecting(np.mean), ValueError, "`arrays`"),
        (lambda: metrics.collecting("f", np.ones(3)), TypeError, "`fn`"),
        (lambda: metrics.collecting(np.mean, np.ones(3), mask=[1, 0]), ValueError, "`mask`"),
        (
            lambda: metrics.collecting(np.mean, np.ones((2, 2))).merge(
                metrics.collecting(np.mean, np.ones((2, 3)))
            ),
            ValueError,
            "trailing shape",
        ),
        (lambda: metrics.Collecting.empty(np.mean).compute(), ValueError, "no data"),
        (
            lambda: metrics.collecting(np.mean, np.ones(2)).merge(
                metrics.collecting(np.median, np.ones(2))
            ),
            ValueError,
            "`fn`",
        ),
    ],
    ids=["rows", "no_arrays", "fn", "mask", "trailing", "empty", "different_fn"],
)
def test_collecting_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()
