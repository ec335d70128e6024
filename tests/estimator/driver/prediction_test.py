"""predict()'s driver (``driver/prediction.py``): each real example once, in input order,
the keys asked for only.

The driver runs on a ``Job`` (one device, ``tests/estimator/driver/jobs.py``) over a
checkpoint written by a short training run; the reference is a numpy forward pass of the
checkpoint's variables and the row ids the input carries.
"""

from __future__ import annotations

import numpy as np
import pytest

from estimator.core.errors import EstimatorTypeError, EstimatorValueError
from estimator.driver.prediction import checked_predict_keys, run_predict_loops
from tests import helpers as h
from tests.estimator.driver import jobs

BATCH = 8
N = BATCH * 3 + 5  # the last batch has 5 real rows of 8


@pytest.mark.parametrize(
    "keys, expected",
    [(None, None), ("logits", ["logits"]), (["a", "b"], ["a", "b"]), (("a",), ("a",)), ([], [])],
)
def test_checked_predict_keys(keys, expected):
    assert checked_predict_keys(keys) == expected


@pytest.mark.parametrize("keys", [3, ["a", 1], {"a"}, b"logits"])
def test_predict_keys_of_another_type_are_refused(keys):
    with pytest.raises(EstimatorTypeError, match="predict_keys must be a str or a list"):
        checked_predict_keys(keys)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model_dir with a checkpoint of 2 steps, the checkpoint's variables, and data."""
    model_dir = tmp_path_factory.mktemp("predict")
    x, y = h.make_data(n=N)
    est = h.make_estimator(model_dir, batch=BATCH, ipl=2, use_tpu=False)
    est.train(h.train_input_fn(x, y), max_steps=2)
    return model_dir, h.params_of(est), x


def _logits(p: dict, x: np.ndarray) -> np.ndarray:
    hidden = np.maximum(x @ p["hidden/kernel"] + p["hidden/bias"], 0.0)
    return hidden @ p["out/kernel"] + p["out/bias"]


def _predict(model_dir, x, **kw):
    job = jobs.make_job(model_dir, batch=BATCH, ipl=2)
    kw.setdefault("predict_keys", None)
    kw.setdefault("yield_single_examples", True)
    return list(
        run_predict_loops(
            job, h.eval_input_fn(x, with_row=True), hooks=(), checkpoint_path=None, **kw
        )
    )


def test_each_real_example_once_in_input_order(trained):
    model_dir, params, x = trained
    got = _predict(model_dir, x)
    assert len(got) == N
    np.testing.assert_array_equal([p["row"] for p in got], np.arange(N))
    logits = np.stack([p["logits"] for p in got])
    np.testing.assert_allclose(logits, _logits(params, x), rtol=1e-5, atol=1e-5)


def test_batches_keep_only_their_real_rows(trained):
    model_dir, params, x = trained
    got = _predict(model_dir, x, yield_single_examples=False, predict_keys=["row"])
    assert [sorted(b) for b in got] == [["row"]] * 4
    assert [len(b["row"]) for b in got] == [BATCH, BATCH, BATCH, 5]
    np.testing.assert_array_equal(np.concatenate([b["row"] for b in got]), np.arange(N))


def test_a_key_model_fn_does_not_predict_is_an_error_naming_the_available(trained):
    model_dir, _, x = trained
    with pytest.raises(EstimatorValueError, match=r"\['nope'\] not found.*'logits', 'row'"):
        _predict(model_dir, x, predict_keys=["nope"])
