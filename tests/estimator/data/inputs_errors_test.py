"""Input mistakes a newcomer makes, each a clear error naming the entry (issue 30, item 7).

Before: complex64 features failed inside Flax (``Expected the input to have a dtype that is a
subdtype of floating``); Python lists and ragged lists were "``[0]['x'][0][0]`` is a
scalar"; a Keras-style ``(x, y, sample_weight)`` 3-tuple was "model_fn failed with
labels=None (TracerArrayConversionError ...)". Negative class ids are refused by the
metrics that need ids in range, naming ``labels``.
"""

from __future__ import annotations

import numpy as np
import pytest

import estimator
import metrics
from tests import helpers as h

X, Y = h.make_data()


def _train(tmp_path, batch):
    est = h.make_estimator(tmp_path)
    est.train(lambda params: iter([batch] * 4), max_steps=2)


def test_complex_features_are_an_error_naming_the_entry(tmp_path):
    with pytest.raises(TypeError) as info:
        _train(tmp_path, ({"x": X[:16].astype(np.complex64)}, Y[:16]))
    message = str(info.value)
    assert "['x']" in message and "complex64" in message and "np.real" in message


def test_a_python_list_is_an_error_saying_to_make_it_an_array(tmp_path):
    with pytest.raises(ValueError) as info:
        _train(tmp_path, ({"x": X[:16].tolist()}, Y[:16].tolist()))
    message = str(info.value)
    assert "['x']" in message and "Python list" in message and "np.asarray" in message
    assert "is a scalar" not in message


def test_a_ragged_list_is_an_error_saying_it_is_ragged(tmp_path):
    with pytest.raises(ValueError) as info:
        _train(tmp_path, ({"x": [[1.0, 2.0], [3.0]] * 8}, Y[:16]))
    message = str(info.value)
    assert "['x']" in message and "ragged" in message and "pad" in message


def test_a_three_tuple_says_only_a_pair_is_features_and_labels(tmp_path):
    with pytest.raises(ValueError) as info:
        _train(tmp_path, ({"x": X[:16]}, Y[:16], np.ones(16, np.float32)))
    message = str(info.value)
    assert "3-tuple" in message and "(features, labels)" in message


def _metric_model_fn(features, labels, mode, params):
    spec = h.model_fn(features, labels, mode, params)
    if mode == estimator.ModeKeys.EVAL:

        def metric_fn(labels, logits):
            predicted = logits.argmax(-1)
            return {"per_class": metrics.mean_per_class_accuracy(labels, predicted, num_classes=3)}

        spec.eval_metrics = (metric_fn, [labels, spec.eval_metrics[1][1]])
    return spec


def test_negative_class_ids_reaching_a_classification_metric_name_labels(tmp_path):
    est = h.make_estimator(tmp_path, _metric_model_fn)
    est.train(h.train_input_fn(X, Y), max_steps=2)
    bad = np.where(np.arange(16) == 3, -1, Y[:16]).astype(np.int32)
    with pytest.raises(ValueError) as info:
        est.evaluate(lambda params: iter([({"x": X[:16]}, bad)]), steps=1)
    message = str(info.value)
    assert "`labels`" in message and "num_classes=3" in message and "-1" in message
