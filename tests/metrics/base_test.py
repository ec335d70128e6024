"""Tests for metrics/base.py: the Metric interface, merge checks, user-defined metrics."""

import dataclasses
import doctest
import importlib

import numpy as np
import pytest

import metrics

MODULES = [
    "metrics",
    "metrics.base",
    "metrics._aggregate",
    "metrics._auc",
    "metrics._classification",
    "metrics._confusion",
    "metrics._ranking",
    "metrics._regression",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


@dataclasses.dataclass(frozen=True)
class _Count(metrics.Metric):
    """A user metric relying on the default (additive) merge."""

    hits: float
    total: np.ndarray
    k: int = metrics.static_field(default=1)

    @classmethod
    def from_model_output(cls, hits, *, k=1):
        hits = np.asarray(hits, np.float64)
        return cls(float(hits.sum()), np.array([hits.size, 1.0]), k)

    @classmethod
    def empty(cls, *, k=1):
        return cls(0.0, np.zeros(2), k)

    def compute(self):
        return self.hits / self.total[0] if self.total[0] else 0.0


class _NotADataclass(metrics.Metric):
    @classmethod
    def from_model_output(cls):
        return cls()

    def compute(self):
        return 0.0


def test_default_merge_adds_state_and_keeps_config():
    merged = _Count.from_model_output([1, 0], k=3).merge(_Count.from_model_output([1], k=3))
    assert merged.hits == 2.0
    np.testing.assert_array_equal(merged.total, [3.0, 2.0])
    assert merged.k == 3
    assert merged.config() == {"k": 3}
    assert merged.compute() == pytest.approx(2 / 3)


def test_merge_returns_new_object_and_leaves_inputs_alone():
    a, b = _Count.from_model_output([1]), _Count.from_model_output([0, 0])
    merged = a.merge(b)
    assert merged is not a and merged is not b
    assert a.hits == 1.0 and b.hits == 0.0
    np.testing.assert_array_equal(a.total, [1.0, 1.0])


def test_empty_is_identity():
    m = _Count.from_model_output([1, 0, 1])
    assert _Count.empty().merge(m).compute() == m.compute()
    assert m.merge(_Count.empty()).compute() == m.compute()


def test_merge_with_different_static_config_names_the_field():
    with pytest.raises(ValueError, match="`k`"):
        _Count.from_model_output([1], k=1).merge(_Count.from_model_output([1], k=2))


def test_merge_with_other_type_is_type_error():
    with pytest.raises(TypeError, match="Cannot merge _Count with Mean"):
        _Count.from_model_output([1]).merge(metrics.mean([1.0]))


def test_merge_with_non_metric_names_other():
    with pytest.raises(TypeError, match="`other`"):
        _Count.from_model_output([1]).merge(3.0)


def test_non_dataclass_subclass_must_override_merge():
    m = _NotADataclass.from_model_output()
    assert m.config() == {}
    with pytest.raises(NotImplementedError, match="_merge"):
        m.merge(_NotADataclass())


def test_empty_not_defined_is_clear():
    with pytest.raises(NotImplementedError, match="_NotADataclass does not define empty"):
        _NotADataclass.empty()


def test_metric_is_abstract():
    with pytest.raises(TypeError):
        metrics.Metric()


def test_public_names_are_exported():
    for name in metrics.__all__:
        assert hasattr(metrics, name), name
    for factory in [
        "accuracy",
        "mean",
        "precision",
        "recall",
        "auc",
        "mean_squared_error",
        "root_mean_squared_error",
        "mean_absolute_error",
        "mean_per_class_accuracy",
        "mean_iou",
        "true_positives",
        "false_positives",
        "true_negatives",
        "false_negatives",
        "recall_at_k",
        "as_metric",
    ]:
        assert callable(getattr(metrics, factory)), factory


def test_metrics_does_not_import_jax():
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    code = "import sys, metrics; assert 'jax' not in sys.modules, 'metrics imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
