"""An input_fn that returns one ``(features, labels)`` / ``(features, None)`` pair (issue 41):
one batch, as TF's input_fn returned tensors; repeated in TRAIN, once in EVAL and PREDICT."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import pytest

import estimator
from estimator.core.input_context import InputContext
from estimator.data.inputs import call_input_fn
from estimator.data.single_batch import as_batches
from tests import helpers as h

B = 16
X, Y = h.make_data(n=64)
TRAIN, EVAL, PREDICT = estimator.ModeKeys.TRAIN, estimator.ModeKeys.EVAL, estimator.ModeKeys.PREDICT


class Pair(NamedTuple):
    image: np.ndarray
    mask: np.ndarray


def _call(input_fn, mode, batch_size=B):
    return call_input_fn(
        input_fn,
        params={"batch_size": batch_size},
        config=None,
        mode=mode,
        input_context=InputContext(1, 0, 1),
    )


def test_a_pair_is_one_batch_repeated_in_train_and_seen_once_elsewhere():
    pair = ({"random_noise": X[:B]}, None)
    train = list(itertools.islice(_call(lambda params: pair, TRAIN), 5))
    assert len(train) == 5 and all(b is pair for b in train)
    for mode in (EVAL, PREDICT):
        assert list(_call(lambda params: pair, mode)) == [pair]
    labelled = ({"x": X[:B]}, Y[:B])
    assert list(_call(lambda params: labelled, EVAL)) == [labelled]
    arrays = (X[:B], Y[:B])  # features as one array
    assert list(_call(lambda params: arrays, EVAL)) == [arrays]


@pytest.mark.parametrize(
    "data, batches",
    [
        ([({"x": X[:B]}, Y[:B]), ({"x": X[B : 2 * B]}, Y[B : 2 * B])], 2),  # a list of batches
        ((({"x": X[:B]}, Y[:B]), ({"x": X[B : 2 * B]}, Y[B : 2 * B])), 2),  # a tuple of pairs
        ([{"x": X[:B]}, {"x": X[B : 2 * B]}], 2),  # a list of two feature batches
        ((Pair(X[:B], X[:B]), Pair(X[B : 2 * B], X[B : 2 * B])), 2),  # namedtuple batches
    ],
    ids=["list of pairs", "tuple of pairs", "list of feature dicts", "tuple of namedtuples"],
)
def test_iterables_of_batches_are_read_as_before(data, batches):
    assert as_batches(data, mode=EVAL, batch_size=B) is None
    assert len(list(_call(lambda params: data, EVAL))) == batches


def test_an_ambiguous_pair_says_both_readings():
    with pytest.raises(ValueError, match=r"ambiguous.*features \[16\], labels \[10\].*list"):
        _call(lambda params: ({"x": X[:B]}, Y[:10]), TRAIN)


def test_a_whole_data_set_returned_as_one_pair_names_the_batch_size():
    with pytest.raises(ValueError, match=r"one \(features, labels\) batch of 64 rows.*is 16"):
        _call(lambda params: ({"x": X}, Y), TRAIN)


def test_estimator_trains_evaluates_and_predicts_on_one_returned_pair(tmp_path):
    est = h.make_estimator(tmp_path, ipl=2)
    est.train(
        lambda params: ({"x": X[: params["batch_size"]]}, Y[: params["batch_size"]]), max_steps=3
    )
    assert estimator.load_global_step(str(tmp_path)) == 3
    results = est.evaluate(lambda params: ({"x": X[:B]}, Y[:B]))
    assert results["global_step"] == 3 and 0.0 <= results["accuracy"] <= 1.0
    # DCGAN's noise input: features only, labels None, predicted once
    preds = list(est.predict(lambda params: ({"x": X[: params["batch_size"]]}, None)))
    assert len(preds) == B
