"""Goodput across restarts: ``goodput.json``'s totals at each checkpoint, the time a crashed
run lost after its last checkpoint, and calls that add up without loss."""

from __future__ import annotations

import json
import logging

import pytest

import hooks
from estimator.driver import goodput, goodput_record
from estimator.io import checkpoint as ckpt_lib
from tests import helpers as h
from tests.estimator.driver import tb_reader


def test_restarts_add_the_time_after_the_restored_checkpoint_as_lost(tmp_path):
    kept = {
        "step": 7,
        "checkpoint_step": 6,
        "checkpoints": {
            "2": {"wall_s": 5.0, "productive_s": 3.0, "host_s": 2.0},
            "6": {"wall_s": 10.0, "productive_s": 6.0, "host_s": 4.0},
        },
        "totals": {"wall_s": 13.0, "productive_s": 8.5, "host_s": 4.5},
    }
    (tmp_path / goodput.FILE).write_text(json.dumps(kept))
    gp = goodput.Goodput(model_dir=str(tmp_path))
    goodput_record.resume(gp, str(tmp_path), {"global_step": 6})
    assert gp.base["wall_s"] == 13.0 and gp.base["lost_s"] == 3.0
    assert gp.base["productive_s"] == 6.0  # the lost steps' time is not productive
    # An older checkpoint restored (the newer one was damaged): more is lost.
    goodput_record.resume(gp, str(tmp_path), {"global_step": 2})
    assert gp.base["wall_s"] == 13.0 and gp.base["lost_s"] == 8.0
    # A checkpoint the record does not list: from zero.
    goodput_record.resume(gp, str(tmp_path), {"global_step": 4})
    assert gp.base == goodput.zero_totals()


def _estimator(model_dir, **cfg):
    return h.make_estimator(model_dir, ipl=2, save_summary_steps=2, **cfg)


class _Crash(hooks.SessionRunHook):
    """Fails after the loop that reaches ``step`` (as a crash would stop the run there)."""

    def __init__(self, step):
        self.step = step

    def after_run(self, run_context, run_values):
        if run_context.steps[-1] >= self.step:
            raise RuntimeError("crash")


def test_totals_accumulate_across_restarts_with_the_lost_time(tmp_path, caplog):
    x, y = h.make_data(n=64)
    est = _estimator(tmp_path, save_checkpoints_steps=4)
    with pytest.raises(RuntimeError, match="crash"):
        est.train(h.train_input_fn(x, y), max_steps=12, hooks=[_Crash(6)])
    crashed = json.loads((tmp_path / goodput.FILE).read_text())
    assert (crashed["step"], crashed["checkpoint_step"]) == (6, 4)
    lost = crashed["totals"]["wall_s"] - crashed["checkpoints"]["4"]["wall_s"]
    assert lost > 0
    with caplog.at_level(logging.INFO, logger="estimator"):
        _estimator(tmp_path, save_checkpoints_steps=4).train(h.train_input_fn(x, y), max_steps=12)
    assert any(
        "reached step 6 after the checkpoint at step 4" in r.getMessage() for r in caplog.records
    )
    mux = tb_reader.multiplexer(tmp_path)
    total = {t: tb_reader.scalars(mux, ".", f"goodput/{t}")[12] for t in goodput_record.TAGS}
    assert total["lost_s"] == pytest.approx(lost, rel=1e-4)
    assert total["wall_s"] > crashed["totals"]["wall_s"]
    assert sum(total[f"{p}_s"] for p in goodput.PARTS) == pytest.approx(total["wall_s"], rel=1e-4)
    # no time in the checkpoint itself: the same job writes the same files
    assert "goodput" not in ckpt_lib.Checkpoints(str(tmp_path), read_only=True).meta(12)


def test_calls_that_end_at_their_checkpoint_lose_nothing(tmp_path):
    x, y = h.make_data(n=64)
    est = _estimator(tmp_path)
    walls = []
    for _ in range(2):
        est.train(h.train_input_fn(x, y), steps=4)
        walls.append(json.loads((tmp_path / goodput.FILE).read_text())["totals"]["wall_s"])
    mux = tb_reader.multiplexer(tmp_path)
    assert tb_reader.scalars(mux, ".", "goodput/lost_s") == {4: 0.0, 8: 0.0}
    assert walls[1] > walls[0]  # the second call's time is added to the first's
