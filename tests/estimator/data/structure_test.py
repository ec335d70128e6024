"""data/structure.py: rows given as a Python list of arrays, and a batch whose structure
changed, each told in one short line naming the entry (issue 42: a screen-long PyTreeDef,
or every row by name)."""

from __future__ import annotations

import numpy as np
import pytest

from tests import helpers as h

X, Y = h.make_data()
LIMIT = 700  # characters: a message, not a screen


def _train(tmp_path, batches):
    est = h.make_estimator(tmp_path)
    est.train(lambda params: iter(batches), max_steps=2)


def test_ragged_rows_as_a_list_of_arrays_name_the_list(tmp_path):
    rows = [X[i][: 3 + i % 2] for i in range(16)]  # rows of 3 and 4 values
    with pytest.raises(ValueError) as info:
        _train(tmp_path, [({"x": rows}, Y[:16])] * 4)
    message = str(info.value)
    assert message.startswith("input batch entry [0]['x'] is a Python list of 16 arrays")
    assert "((3,), (4,))" in message and "pad them" in message and "np.stack" in message
    assert len(message) < LIMIT


def test_rows_that_are_not_stacked_are_named_a_few_at_a_time(tmp_path):
    rows = [X[i] for i in range(16)]  # one array per row, all (6,): not batch-major
    with pytest.raises(ValueError) as info:
        _train(tmp_path, [({"x": rows}, Y[:16])] * 4)
    message = str(info.value)
    assert "[0]['x'][0] (shape (6,)), [0]['x'][1] (shape (6,)), [0]['x'][2]" in message
    assert "and 13 more does not lead with the batch dimension" in message
    assert len(message) < LIMIT


def test_a_batch_whose_entry_became_a_list_of_rows_is_one_short_line(tmp_path):
    good = ({"x": X[:16]}, Y[:16])
    rows = ({"x": [X[i] for i in range(16)]}, Y[:16])
    with pytest.raises(ValueError) as info:
        _train(tmp_path, [good, rows, rows, rows])
    message = str(info.value)
    assert "PyTreeDef" not in message
    assert message.startswith(
        "input batch structure changed: the first batch's entries were [0]['x'], [1]; this "
        "batch no longer has [0]['x']; now has [0]['x'][0], [0]['x'][1], [0]['x'][2] and 13 "
        "more; [0]['x'] became a Python list"
    ), message
    assert len(message) < LIMIT


def test_a_list_of_feature_arrays_of_one_batch_is_not_mistaken_for_rows(tmp_path):
    features = [X[:16], X[:16, :2], np.ones((16, 1), np.float32)]  # three inputs, batch-major

    def model_fn(features, labels, mode, params):
        return h.model_fn(features[0], labels, mode, params)

    est = h.make_estimator(tmp_path, model_fn)
    est.train(lambda params: iter([(features, Y[:16])] * 4), max_steps=2)
