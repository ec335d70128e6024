"""Tests for metrics/_regression.py against scikit-learn."""

import numpy as np
import pytest
from sklearn import metrics as skm

import metrics

RNG = np.random.default_rng(1)
N = 200


def _data(shape):
    return RNG.normal(size=shape), RNG.normal(size=shape)


CASES = [
    # name, factory, sklearn reference
    ("mse", metrics.mean_squared_error, skm.mean_squared_error),
    # sklearn's multi-output RMSE averages per-column roots; TF's is one root over all entries.
    (
        "rmse",
        metrics.root_mean_squared_error,
        lambda *a, **k: np.sqrt(skm.mean_squared_error(*a, **k)),
    ),
    ("mae", metrics.mean_absolute_error, skm.mean_absolute_error),
]


@pytest.mark.parametrize("name, factory, reference", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("shape", [(N,), (N, 3)], ids=["vector", "matrix"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_matches_sklearn(name, factory, reference, shape, weighted):
    labels, predictions = _data(shape)
    weights = RNG.uniform(0, 3, size=N) * (RNG.uniform(size=N) > 0.2) if weighted else None
    expected = reference(labels, predictions, sample_weight=weights)
    value = factory(labels, predictions, weights).compute()
    assert type(value) is float
    assert value == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name, factory, reference", CASES, ids=[c[0] for c in CASES])
def test_trailing_unit_axis_is_squeezed(name, factory, reference):
    labels, predictions = _data((N,))
    expected = reference(labels, predictions)
    assert factory(labels[:, None], predictions).compute() == pytest.approx(expected)
    assert factory(labels, predictions[:, None]).compute() == pytest.approx(expected)


def test_rmse_takes_root_after_merging():
    a = metrics.root_mean_squared_error([0.0], [3.0])
    b = metrics.root_mean_squared_error([0.0], [4.0])
    assert a.merge(b).compute() == pytest.approx(np.sqrt((9 + 16) / 2))


def test_integer_inputs_do_not_overflow_or_wrap():
    labels = np.array([0, 0], np.uint8)
    predictions = np.array([255, 1], np.uint8)
    assert metrics.mean_absolute_error(labels, predictions).compute() == 128.0
