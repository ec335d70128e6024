"""Goodput: the accumulator's parts (a fake clock), and a train call's parts against its
wall time in TensorBoard's ``goodput/`` scalars and ``goodput.json``."""

from __future__ import annotations

import json
import logging
import time

import pytest

from estimator.driver import goodput, goodput_record
from tests import helpers as h
from tests.estimator.driver import tb_reader


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_time_goes_to_the_current_part_and_the_rest_to_host():
    clock = _Clock()
    gp = goodput.Goodput(clock=clock)
    clock.now = 1.0  # start-up: host
    with gp.phase("productive"):
        clock.now = 4.0
        with gp.phase("input_wait"):
            clock.now = 4.5
        clock.now = 6.0
    with gp.phase("checkpoint"):
        clock.now = 6.25
    clock.now = 7.0
    got = gp.totals()
    assert got["productive_s"] == 4.5 and got["input_wait_s"] == 0.5
    assert got["checkpoint_s"] == 0.25 and got["host_s"] == 1.75
    assert got["wall_s"] == 7.0 and got["fraction"] == pytest.approx(4.5 / 7.0)


def test_compiles_inside_a_part_are_moved_to_compile_and_nested_ones_count_once():
    clock = _Clock()
    gp = goodput.Goodput(clock=clock)
    with gp.phase("productive"):
        clock.now = 2.0
        gp.compiled(0.5)  # a trace nested in the compile reported next
        clock.now = 3.0
        gp.compiled(2.0)  # 1.0-3.0, covering the trace's 1.5-2.0
        clock.now = 5.0
    got = gp.call_totals()
    assert got["compile_s"] == 2.0 and got["productive_s"] == 3.0
    assert sum(got[f"{p}_s"] for p in goodput.PARTS) == got["wall_s"] == 5.0


def test_marks_do_nothing_outside_an_active_accumulator_or_on_another_thread():
    items = [1, 2]
    assert goodput.each(items, "input_wait") is items
    with goodput.phase("checkpoint"):
        pass
    clock = _Clock()
    gp = goodput.Goodput(clock=clock)
    with goodput.active(gp):
        assert list(goodput.each(iter(items), "input_wait")) == items
        gp.owner = -1  # as if another thread asked
        assert goodput.each(items, "input_wait") is items


# ------------------------------------------------------------------ end to end
def _estimator(model_dir, **cfg):
    return h.make_estimator(model_dir, ipl=2, save_summary_steps=2, **cfg)


def test_a_train_calls_parts_sum_to_its_wall_time(tmp_path, caplog):
    x, y = h.make_data(n=64)
    est = _estimator(tmp_path)
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="estimator"):
        est.train(h.train_input_fn(x, y), max_steps=12)
    wall = time.monotonic() - start
    mux = tb_reader.multiplexer(tmp_path)
    got = {t: tb_reader.scalars(mux, ".", f"goodput/{t}")[12] for t in goodput_record.TAGS}
    parts = sum(got[f"{p}_s"] for p in goodput.PARTS)
    assert parts == pytest.approx(got["wall_s"], rel=1e-4)  # by construction
    assert got["wall_s"] <= wall  # written before train closes its summaries
    assert got["productive_s"] > 0 and got["compile_s"] > 0 and got["lost_s"] == 0
    assert got["fraction"] == pytest.approx(got["productive_s"] / got["wall_s"], rel=1e-4)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Goodput:")]
    assert "productive" in line and "lost to restarts 0.00 s" in line
    kept = json.loads((tmp_path / goodput.FILE).read_text())  # written as train returns
    assert kept["step"] == kept["checkpoint_step"] == 12
    assert kept["totals"]["wall_s"] == pytest.approx(wall, rel=0.05)  # the call's wall
    kept_parts = sum(kept["totals"][f"{p}_s"] for p in goodput.PARTS)
    assert kept_parts == pytest.approx(kept["totals"]["wall_s"], rel=1e-4)
