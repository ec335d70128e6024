"""Streaming properties of every factory: merging batches equals one pass over all rows.

One table lists each metric with a data generator; every test runs over the whole table.
"""

import functools
import zlib

import numpy as np
import pytest

import metrics

N = 240


def _binary(rng, n):
    labels = rng.integers(0, 2, n)
    return {"labels": labels, "predictions": np.clip(0.3 * labels + rng.uniform(0, 0.7, n), 0, 1)}


def _classes(rng, n, c=4):
    labels = rng.integers(0, c, n)
    return {"labels": labels, "predictions": np.where(rng.uniform(size=n) < 0.5, labels, 0)}


def _regression(rng, n):
    return {"labels": rng.normal(size=(n, 2)), "predictions": rng.normal(size=(n, 2))}


def _scores(rng, n, c=5):
    return {"labels": rng.integers(0, c, n), "predictions": rng.normal(size=(n, c))}


# name -> (factory, data generator, static options, exact: float-free counts with int weights)
CASES = {
    "mean": (metrics.mean, lambda rng, n: {"values": rng.normal(size=(n, 3))}, {}, False),
    "accuracy": (metrics.accuracy, _classes, {}, True),
    "precision": (metrics.precision, _binary, {}, False),
    "recall": (metrics.recall, _binary, {}, False),
    "precision_thresholds": (metrics.precision, _binary, {"thresholds": [0.3, 0.6]}, False),
    "true_positives": (metrics.true_positives, _binary, {}, True),
    "false_positives": (metrics.false_positives, _binary, {}, True),
    "true_negatives": (metrics.true_negatives, _binary, {}, True),
    "false_negatives": (metrics.false_negatives, _binary, {"thresholds": [0.1, 0.9]}, True),
    "auc_roc": (metrics.auc, _binary, {}, False),
    "auc_pr_careful": (
        metrics.auc,
        _binary,
        {"curve": "PR", "summation_method": "careful_interpolation", "num_thresholds": 50},
        False,
    ),
    "mean_squared_error": (metrics.mean_squared_error, _regression, {}, False),
    "root_mean_squared_error": (metrics.root_mean_squared_error, _regression, {}, False),
    "mean_absolute_error": (metrics.mean_absolute_error, _regression, {}, False),
    "mean_per_class_accuracy": (
        metrics.mean_per_class_accuracy,
        _classes,
        {"num_classes": 4},
        False,
    ),
    "mean_iou": (metrics.mean_iou, _classes, {"num_classes": 4}, False),
    "recall_at_k": (metrics.recall_at_k, _scores, {"k": 2}, False),
    "recall_at_k_class": (metrics.recall_at_k, _scores, {"k": 2, "class_id": 1}, False),
}
NAMES = sorted(CASES)


def _make(name, rows, weights=None):
    factory, _, options, _ = CASES[name]
    return factory(**rows, weights=weights, **options)


def _empty(name, metric):
    return type(metric).empty(**CASES[name][2])


def _split(rng, n):
    """Random batch boundaries, with empty batches sprinkled in."""
    cuts = np.sort(rng.integers(0, n + 1, size=9))
    cuts = np.concatenate([[0], cuts, cuts[:3], [n]])  # repeated cuts -> empty batches
    return sorted(cuts.tolist())


def _assert_same(a, b, exact):
    if exact:
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("weighting", ["none", "integer", "float"])
@pytest.mark.parametrize("name", NAMES)
def test_merged_batches_equal_concatenation(name, weighting):
    rng = np.random.default_rng(zlib.crc32(f"{name}/{weighting}".encode()))
    rows = CASES[name][1](rng, N)
    weights = {
        "none": None,
        "integer": rng.integers(0, 3, N).astype(float),
        "float": rng.uniform(0, 2, N) * (rng.uniform(size=N) > 0.2),
    }[weighting]
    whole = _make(name, rows, weights)
    cuts = _split(rng, N)
    parts = [
        _make(
            name,
            {k: v[lo:hi] for k, v in rows.items()},
            None if weights is None else weights[lo:hi],
        )
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    merged = functools.reduce(lambda a, b: a.merge(b), parts)
    assert type(merged) is type(whole)
    _assert_same(merged.compute(), whole.compute(), CASES[name][3] and weighting != "float")


@pytest.mark.parametrize("name", NAMES)
def test_merge_is_associative_and_empty_is_identity(name):
    rng = np.random.default_rng(7)
    rows = CASES[name][1](rng, 90)
    a, b, c = (_make(name, {k: v[i : i + 30] for k, v in rows.items()}) for i in (0, 30, 60))
    _assert_same(a.merge(b).merge(c).compute(), a.merge(b.merge(c)).compute(), exact=False)
    empty = _empty(name, a)
    _assert_same(empty.merge(a).compute(), a.compute(), exact=True)
    _assert_same(a.merge(empty).compute(), a.compute(), exact=True)


@pytest.mark.parametrize("name", NAMES)
def test_no_rows_and_zero_weights_compute_zero(name):
    rng = np.random.default_rng(8)
    rows = CASES[name][1](rng, 10)
    no_rows = _make(name, {k: v[:0] for k, v in rows.items()})
    zero_weights = _make(name, rows, np.zeros(10))
    expected = np.zeros_like(np.asarray(no_rows.compute()))
    for metric in (no_rows, zero_weights, _empty(name, no_rows)):
        value = metric.compute()
        np.testing.assert_array_equal(value, expected)
        assert not np.any(np.isnan(value))


@pytest.mark.parametrize("name", NAMES)
def test_mask_equals_zero_weights(name):
    rng = np.random.default_rng(9)
    rows = CASES[name][1](rng, 40)
    keep = rng.uniform(size=40) > 0.3
    factory, _, options, _ = CASES[name]
    masked = factory(**rows, mask=keep, **options)
    weighted = _make(name, rows, keep.astype(float))
    _assert_same(masked.compute(), weighted.compute(), exact=True)


@pytest.mark.parametrize("name", NAMES)
def test_scalar_results_are_python_floats(name):
    rows = CASES[name][1](np.random.default_rng(10), 20)
    value = _make(name, rows).compute()
    if np.ndim(value) == 0:
        assert type(value) is float


@pytest.mark.parametrize("name", NAMES)
def test_inputs_are_not_modified_and_state_is_independent(name):
    rows = CASES[name][1](np.random.default_rng(11), 20)
    copies = {k: v.copy() for k, v in rows.items()}
    a = _make(name, rows)
    before = a.compute()
    a.merge(a).merge(a)
    for k in rows:
        np.testing.assert_array_equal(rows[k], copies[k])
    _assert_same(a.compute(), before, exact=True)
