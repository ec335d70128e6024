"""Evaluate and predict restore a checkpoint once per estimator: a later call of the same
checkpoint reads and places nothing (a newer or rewritten checkpoint is read again), the
checkpoint meta says whether to look for a moving average (a meta without the flag is looked
into), and a model split over replicas is made whole by one program compiled once."""

from __future__ import annotations

import glob
import json
import os
import shutil

import flax.linen as nn
import optax
import pytest

import estimator
from estimator.core.compilation import CompileCounter
from estimator.driver import evaluation
from estimator.io import checkpoint as ckpt_lib
from estimator.io.meta_format import with_checksum
from tests import helpers as h

X, Y = h.make_data(n=64)


def _counting(monkeypatch, owner, name: str) -> list:
    """Records the positional arguments of each call of ``owner.name``."""
    calls: list = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _train(model_dir, steps: int, *, seed: int = 0, **kw) -> estimator.TPUEstimator:
    x, y = h.make_data(n=64, seed=seed)
    est = h.make_estimator(model_dir, ipl=2, **kw)
    est.train(h.train_input_fn(x, y), max_steps=steps)
    return est


def _evaluate(est) -> dict:
    return est.evaluate(h.eval_input_fn(X, Y))


def test_a_second_evaluate_or_predict_of_a_checkpoint_reads_and_places_nothing(
    tmp_path, monkeypatch
):
    trained = _train(tmp_path, 2)
    reader = h.make_estimator(tmp_path, ipl=2)  # restores from disk
    restores = _counting(monkeypatch, ckpt_lib.Checkpoints, "restore")
    placed = _counting(monkeypatch, evaluation, "one_copy_on_cpu")
    first = _evaluate(reader)
    assert (len(restores), len(placed)) == (1, 1)
    assert _evaluate(reader) == first
    assert (len(restores), len(placed)) == (1, 1)  # nothing read, nothing placed again
    assert _evaluate(trained) == _evaluate(trained)  # from the state train left
    assert _evaluate(trained) == pytest.approx(first)
    assert (len(restores), len(placed)) == (1, 2)
    predicted = [p["logits"] for p in reader.predict(h.eval_input_fn(X))]
    again = [p["logits"] for p in reader.predict(h.eval_input_fn(X))]
    assert len(restores) == 2 and len(predicted) == len(X)  # predict's variables read once
    assert all((a == b).all() for a, b in zip(predicted, again, strict=True))


def test_a_newer_or_rewritten_checkpoint_is_read_again(tmp_path, monkeypatch):
    _train(tmp_path, 2)
    reader = h.make_estimator(tmp_path, ipl=2)
    restores = _counting(monkeypatch, ckpt_lib.Checkpoints, "restore")
    at_2 = _evaluate(reader)
    newer = _train(tmp_path, 4)  # the same run, trained on: a newer checkpoint
    restores.clear()
    at_4 = _evaluate(reader)
    assert (at_2["global_step"], at_4["global_step"], len(restores)) == (2, 4, 1)
    assert at_4 == pytest.approx(_evaluate(newer))
    # A new run at the same step in the same place: another directory, read again.
    shutil.rmtree(tmp_path)
    other = _train(tmp_path, 4, seed=1)
    restores.clear()
    rewritten = _evaluate(reader)
    assert len(restores) == 1
    assert rewritten == pytest.approx(_evaluate(other)) and rewritten["loss"] != at_4["loss"]


def test_training_takes_the_kept_variables_back(tmp_path):
    est = _train(tmp_path, 2)
    _evaluate(est)
    assert est._job.store.placed is not None
    est.train(h.train_input_fn(X, Y), max_steps=4)
    assert est._job.store.placed is None  # dropped before the state went to the loop
    assert _evaluate(est)["global_step"] == 4


def test_a_later_evaluate_of_a_model_split_over_replicas_compiles_nothing(tmp_path):
    # A hidden kernel of 6 x 256 (1,536 elements) is split over the 8 replicas.
    split = {"params": {"hidden": 256}, "tpu": {"shard_params": True}}
    est = _train(tmp_path, 2, **split)
    _evaluate(est)  # compiles the eval loop and the program that makes the params whole
    with CompileCounter() as again:
        at_2 = _evaluate(est)
    est.train(h.train_input_fn(X, Y), max_steps=4)
    with CompileCounter() as newer:
        at_4 = _evaluate(est)  # another checkpoint, gathered by the same program
    assert (again.compiled, newer.compiled) == (0, 0), (again.names, newer.names)
    assert at_4["global_step"] == 4 and at_4["loss"] != at_2["loss"]
    from_disk = _evaluate(h.make_estimator(tmp_path, ipl=2, **split))
    assert from_disk == pytest.approx(at_4)


def _model_fn(make_tx):
    def model_fn(features, labels, mode, params):
        hidden = nn.Dense(16, name="hidden")(features["x"])
        logits = nn.Dense(3, name="out")(nn.relu(hidden))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return estimator.TPUEstimatorSpec(
            mode,
            loss=loss,
            train_op=make_tx() if mode == estimator.ModeKeys.TRAIN else None,
            eval_metrics=(h.metric_fn, [labels, logits]),
        )

    return model_fn


def _without_the_flag(model_dir) -> list:
    """Rewrites every checkpoint's meta as written before the flag existed; the flags."""
    flags = []
    for path in glob.glob(os.path.join(model_dir, "model.ckpt-*", "meta", "metadata")):
        with open(path) as f:
            meta = json.load(f)
        flags.append(meta.pop("moving_average"))
        with open(path, "w") as f:
            json.dump(with_checksum({k: v for k, v in meta.items() if k != "checksum"}), f)
    return flags


def test_a_meta_without_the_moving_average_flag_is_looked_into(tmp_path, monkeypatch):
    ema = estimator.ExponentialMovingAverage(0.5, use_for_eval=True)
    runs = {"plain": lambda: optax.sgd(0.5), "avg": lambda: ema.apply(optax.sgd(0.5))}
    expected, flags = {}, {}
    for name, make_tx in runs.items():
        est = h.make_estimator(tmp_path / name, _model_fn(make_tx), ipl=2)
        est.train(h.train_input_fn(X, Y), max_steps=2)
        expected[name] = _evaluate(est)  # the state train left: the shadow where saved
        flags[name] = set(_without_the_flag(tmp_path / name))
    assert flags == {"plain": {False}, "avg": {True}}  # what each save recorded
    read = _counting(monkeypatch, ckpt_lib.Checkpoints, "item_metadata")
    for name in runs:
        read.clear()
        evaluator = h.make_estimator(tmp_path / name, _model_fn(lambda: None), ipl=2)
        assert _evaluate(evaluator) == pytest.approx(expected[name]), name
        assert "train" in [args[2] for args in read], name  # no flag: looked into, as before
    assert expected["avg"] != expected["plain"]  # the shadow, not the raw weights
