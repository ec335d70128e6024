"""Reading a checkpoint by variable name (``io/checkpoint_read.py``).

Reading saved variables one by one (``get_variable_value``, ``load_variable``) reads the
checkpoint once, hands each caller its own array, and sees a newer or rewritten checkpoint; a
step directory or a model_dir reads what was saved; a Saver's mapping takes each variable from
its checkpoint name and names the variables left unread; the moving averages are read from the
optimizer state, whether the average sits at its top or inside a chain.
"""

from __future__ import annotations

import logging
import shutil

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import estimator
from estimator.core.errors import CheckpointMismatchError
from estimator.io import checkpoint as ckpt_lib
from estimator.io import checkpoint_read
from tests import helpers as h

KERNEL = "hidden/kernel"


def _counting_restores(monkeypatch) -> list:
    calls: list = []
    restore = ckpt_lib.Checkpoints.restore

    def counted(self, step, *args, **kwargs):
        calls.append(step)
        return restore(self, step, *args, **kwargs)

    monkeypatch.setattr(ckpt_lib.Checkpoints, "restore", counted)
    return calls


def _train(model_dir, steps: int, seed: int = 0) -> estimator.TPUEstimator:
    x, y = h.make_data(seed=seed)
    est = h.make_estimator(model_dir, ipl=2)
    est.train(h.train_input_fn(x, y), max_steps=steps)
    return est


def test_every_variable_read_one_by_one_costs_one_checkpoint_read(tmp_path, monkeypatch):
    est = _train(tmp_path, 2)
    calls = _counting_restores(monkeypatch)
    names = est.get_variable_names()
    values = {n: est.get_variable_value(n) for n in names}
    direct = {n: estimator.load_variable(str(tmp_path), n) for n in names}
    assert len(names) >= 5 and len(calls) == 1, calls
    for n in names:
        np.testing.assert_array_equal(values[n], direct[n], err_msg=n)
    # each caller owns its array: changing one changes no later read
    mine = est.get_variable_value(KERNEL)
    mine += 1.0
    np.testing.assert_array_equal(est.get_variable_value(KERNEL), values[KERNEL])
    assert est.get_variable_value("global_step") == 2


def test_a_newer_checkpoint_and_a_rewritten_one_are_read_again(tmp_path, monkeypatch):
    first = _train(tmp_path, 2).get_variable_value(KERNEL)
    est = _train(tmp_path, 4)  # a newer checkpoint in the same model_dir
    assert est.get_variable_value("global_step") == 4
    assert not np.array_equal(est.get_variable_value(KERNEL), first)
    # a new run at the same step in the same place: another directory, another read
    shutil.rmtree(tmp_path)
    other = _train(tmp_path, 4, seed=1)
    calls = _counting_restores(monkeypatch)
    got = other.get_variable_value(KERNEL)
    assert len(calls) == 1
    fresh = h.make_estimator(tmp_path / "elsewhere", ipl=2)
    x, y = h.make_data(seed=1)
    fresh.train(h.train_input_fn(x, y), max_steps=4)
    np.testing.assert_array_equal(got, fresh.get_variable_value(KERNEL))


def test_a_step_directory_or_a_model_dir_reads_what_was_saved(tmp_path):
    """Raw reads (no template) give the arrays the estimator reports, bit for bit."""
    x, y = h.make_data()
    kw = {"params": {"batch_norm": True}, "ipl": 2, "save_checkpoints_steps": 2}
    h.make_estimator(tmp_path, keep_checkpoint_max=None, **kw).train(
        h.train_input_fn(x, y), max_steps=4
    )
    names = checkpoint_read.read_variables(str(tmp_path / "model.ckpt-2"))
    assert names["global_step"] == 2
    est = h.make_estimator(tmp_path, **kw)
    latest = checkpoint_read.read_variables(str(tmp_path))
    assert latest["global_step"] == 4 and any("batch_stats" in n for n in latest)
    for name in est.get_variable_names():
        np.testing.assert_array_equal(latest[name], est.get_variable_value(name))


@pytest.fixture
def three_wide(tmp_path):
    """Checkpoints of a model whose biases are both 3 wide (``hidden/bias`` can be read from
    ``out/bias``); its step-2 values by name; its variables as a template."""
    x, y = h.make_data()
    h.make_estimator(tmp_path, ipl=2, params={"hidden": 3}).train(
        h.train_input_fn(x, y), max_steps=2
    )
    ckpts = ckpt_lib.Checkpoints(str(tmp_path), read_only=True)
    saved = checkpoint_read.named_values(ckpts, 2)
    structs = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), ckpts.restore(2)["variables"]
    )
    return ckpts, saved, structs


def test_a_mapped_read_takes_each_variable_from_its_checkpoint_name(three_wide, caplog):
    ckpts, saved, template = three_wide
    with caplog.at_level(logging.INFO, logger="estimator"):
        got = checkpoint_read.restore_mapped(ckpts, 2, template, {"hidden/bias": "out/bias"})
        checkpoint_read.restore_mapped(ckpts, 2, template, {"hidden/bias": "out/bias"})
    named = estimator.named_variables(got["params"])
    np.testing.assert_array_equal(named["hidden/bias"], saved["out/bias"])
    for name in ("hidden/kernel", "out/kernel", "out/bias"):
        np.testing.assert_array_equal(named[name], saved[name])
    unread = [r.getMessage() for r in caplog.records if "does not read" in r.getMessage()]
    assert len(unread) == 1 and "hidden/bias" in unread[0]  # the left-out one, named once


@pytest.mark.parametrize(
    "sources,match",
    [
        ({"nope": "out/bias"}, "names variable\\(s\\) the model does not have"),
        ({"hidden/bias": "gone"}, "from checkpoint name 'gone'.*not in the checkpoint"),
        ({"hidden/kernel": "out/kernel"}, "checkpoint shape \\(3, 3\\), model shape \\(6, 3\\)"),
    ],
    ids=["unknown model name", "missing checkpoint name", "other shape"],
)
def test_a_mapping_the_checkpoint_cannot_satisfy_is_a_mismatch(three_wide, sources, match):
    ckpts, _, template = three_wide
    with pytest.raises(CheckpointMismatchError, match=match):
        checkpoint_read.restore_mapped(ckpts, 2, template, sources)


def _averaged_model_fn(make_tx):
    def model_fn(features, labels, mode, params):
        logits = nn.Dense(3, name="out")(nn.relu(nn.Dense(8, name="hidden")(features["x"])))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        train_op = make_tx() if mode == estimator.ModeKeys.TRAIN else None
        return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=train_op)

    return model_fn


@pytest.mark.parametrize("where", ["top", "in a chain", "none"])
def test_the_moving_averages_are_read_by_name(tmp_path, where):
    ema = estimator.ExponentialMovingAverage(0.5, use_for_eval=True)
    make_tx = {
        "top": lambda: ema.apply(optax.sgd(0.5)),
        "in a chain": lambda: optax.chain(optax.clip(0.1), ema.apply(optax.sgd(0.5))),
        "none": lambda: optax.sgd(0.5),
    }[where]
    x, y = h.make_data()
    est = h.make_estimator(tmp_path, _averaged_model_fn(make_tx), ipl=2)
    est.train(h.train_input_fn(x, y), max_steps=2)
    ckpts = ckpt_lib.Checkpoints(str(tmp_path), read_only=True)
    shapes = checkpoint_read.moving_average_shapes(ckpts, 2)
    values = checkpoint_read.moving_averages(ckpts, 2)
    shadow = checkpoint_read.moving_average_for_eval(ckpts, 2)
    if where == "none":
        assert (shapes, values, shadow) == ({}, {}, None)
        return
    params = ["hidden/bias", "hidden/kernel", "out/bias", "out/kernel"]
    assert sorted(shapes) == [f"{p}/ExponentialMovingAverage" for p in params]
    assert {n: np.shape(v) for n, v in values.items()} == shapes
    assert sorted(shadow) == params
    for p in params:
        np.testing.assert_array_equal(shadow[p], values[f"{p}/ExponentialMovingAverage"])
    assert checkpoint_read.named_values(ckpts, 2).keys() >= values.keys()
