"""Reading saved variables one by one (``get_variable_value``, ``load_variable``) reads the
checkpoint once, hands each caller its own array, and sees a newer or rewritten checkpoint."""

from __future__ import annotations

import shutil

import numpy as np

import estimator
from estimator.io import checkpoint as ckpt_lib
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
