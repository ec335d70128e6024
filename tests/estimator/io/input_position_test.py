"""Resuming with another ``train_batch_size`` (issue 30, item 4).

The input position was saved as a count of batches and fast-forwarded as batches of the new
size: resumed at batch 32 after 24 steps of 16, 384 examples were silently skipped. It is now
converted to examples. The reference is an independent run: the same checkpoint resumed with
``resume_input_position=False`` on an input that starts at the right example.
"""

from __future__ import annotations

import logging
import shutil

import numpy as np

from tests import helpers as h

X, Y = h.make_data(n=1024)


def _input_fn(offset: int = 0):
    def input_fn(params):
        b = params["batch_size"]
        i = offset
        while True:  # one endless stream of examples, cut into batches of any size
            rows = np.arange(i, i + b) % len(X)
            yield {"x": X[rows]}, Y[rows]
            i += b

    return input_fn


def _resumed_vs_reference(tmp_path, caplog, *, steps_at_16: int, new_batch: int, used: int):
    a, b = tmp_path / "a", tmp_path / "b"
    h.make_estimator(a, batch=16, ipl=4).train(_input_fn(), max_steps=steps_at_16)
    shutil.copytree(a, b)
    with caplog.at_level(logging.WARNING, logger="estimator"):
        resumed = h.make_estimator(a, batch=new_batch, ipl=4)
        resumed.train(_input_fn(), max_steps=steps_at_16 + 4)
    reference = h.make_estimator(b, batch=new_batch, ipl=4, resume_input_position=False)
    reference.train(_input_fn(offset=used), max_steps=steps_at_16 + 4)
    got, want = h.params_of(resumed), h.params_of(reference)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    return [r.getMessage() for r in caplog.records if "batch size" in r.getMessage()]


def test_resuming_with_a_larger_batch_continues_at_the_same_example(tmp_path, caplog):
    said = _resumed_vs_reference(tmp_path, caplog, steps_at_16=24, new_batch=32, used=384)
    assert len(said) == 1, said
    assert "16" in said[0] and "32" in said[0] and "384 examples" in said[0]


def test_a_position_that_is_not_whole_batches_says_what_is_read_again(tmp_path, caplog):
    # 20 steps of 16 = 320 examples: 6 batches of 48 (288 examples); 32 are read again.
    said = _resumed_vs_reference(tmp_path, caplog, steps_at_16=20, new_batch=48, used=288)
    assert len(said) == 1, said
    assert "320 examples" in said[0] and "288" in said[0] and "read again" in said[0]
