"""``iterations_per_loop="auto"``: the bound from the cadences, the candidates and the
choice, the tuner's measurements (a fake clock), and a train call that switches its loops
and says so in the start-up line."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import estimator
import hooks
from estimator.driver import auto_loop
from hooks import SessionRunContext, SessionRunValues
from tests import helpers as h


@pytest.mark.parametrize(
    "cadences, bound",
    [
        ({}, 100),  # TF's defaults: summaries and step logs every 100
        ({"save_summary_steps": 100, "log_step_count_steps": 40}, 20),
        ({"save_checkpoints_steps": 300, "save_summary_steps": 0, "log_step_count_steps": 0}, 300),
        (
            {"save_checkpoints_steps": 5000, "save_summary_steps": 0, "log_step_count_steps": 0},
            1000,
        ),
        ({"save_checkpoints_steps": 1500, "save_summary_steps": 0, "log_step_count_steps": 0}, 750),
        ({"save_summary_steps": 0, "log_step_count_steps": 0}, 1000),
        ({"save_summary_steps": 7, "log_step_count_steps": 100}, 1),
    ],
)
def test_the_bound_skips_no_cadence(cadences, bound):
    config = estimator.RunConfig(
        tpu_config=estimator.TPUConfig(iterations_per_loop="auto"), **cadences
    )
    assert config.tpu_config.iterations_per_loop == bound
    assert config.tpu_config.auto_iterations_per_loop


def test_auto_survives_replace_and_a_fixed_value_ends_it():
    config = estimator.RunConfig(tpu_config=estimator.TPUConfig(iterations_per_loop="auto"))
    changed = config.replace(log_step_count_steps=50)
    assert changed.tpu_config.iterations_per_loop == 50
    assert changed.tpu_config.auto_iterations_per_loop
    fixed = config.replace(tpu_config=config.tpu_config.replace(iterations_per_loop=8))
    assert fixed.tpu_config.iterations_per_loop == 8
    assert not fixed.tpu_config.auto_iterations_per_loop
    with pytest.raises(TypeError):
        estimator.TPUConfig(iterations_per_loop="fast")


@pytest.mark.parametrize(
    "bound, call_steps, expected",
    [
        (100, 100, [1, 2, 4, 5, 10, 20, 25, 50, 100]),
        (100, 25, [1, 2, 4, 5, 10, 20, 25, 50, 100]),
        (100, 8, [1, 2, 4, 5, 100]),  # 10 and 20 would need a tail call of 2 or 4 steps
        (12, 12, [1, 2, 3, 4, 6, 12]),
    ],
)
def test_candidates_divide_the_bound_and_fit_whole_calls(bound, call_steps, expected):
    assert auto_loop.candidates(bound, call_steps=call_steps) == expected


@pytest.mark.parametrize(
    "gap_ms, step_ms, expected",
    [
        (2.0, 8.0, 20),  # needs 12.25 steps: 2 ms is then at most 2% of the loop
        (0.0, 8.0, 1),  # no fixed cost: the shortest loop
        (2.0, 0.001, 100),  # steps of a microsecond: the longest loop, still 95% overhead
    ],
)
def test_choose_the_shortest_loop_with_at_most_two_percent_overhead(gap_ms, step_ms, expected):
    lengths = auto_loop.candidates(100, call_steps=100)
    assert auto_loop.choose(lengths, gap_s=gap_ms / 1e3, step_s=step_ms / 1e3) == expected


def _loop(hook, clock, start, n, *, gap, step_s):
    clock[0] += gap
    steps = np.arange(start + 1, start + n + 1)
    ctx = SessionRunContext(None, None, steps=steps)
    hook.before_run(ctx)
    clock[0] += n * step_s
    hook.after_run(ctx, SessionRunValues(None))
    return start + n


def test_the_tuner_measures_the_second_loop_and_the_gaps_then_applies_once():
    clock, applied, remember = [0.0], [], {}
    tuner = auto_loop.LoopTuner(
        bound=100, call_steps=25, apply=applied.append, remember=remember, clock=lambda: clock[0]
    )
    step = _loop(tuner, clock, 0, 100, gap=0.0, step_s=0.5)  # compiles: not a step time
    step = _loop(tuner, clock, step, 100, gap=0.5, step_s=0.008)  # a one-off gap at start-up
    assert tuner.note is None and not applied
    _loop(tuner, clock, step, 100, gap=0.002, step_s=0.008)
    assert applied == [20] and remember == {auto_loop.CHOSEN: 20}
    assert tuner.note.startswith("auto: 20 (measured 2 ms of host work per loop and 8 ms per step")


def test_a_call_too_short_to_measure_keeps_the_bound():
    clock = [0.0]
    tuner = auto_loop.LoopTuner(
        bound=50, call_steps=50, apply=pytest.fail, remember={}, clock=lambda: clock[0]
    )
    _loop(tuner, clock, 0, 50, gap=0.0, step_s=0.01)
    tuner.end(None)
    assert tuner.note == "auto: 50 (the bound; fewer than three loops ran to measure)"


class _Lengths(hooks.SessionRunHook):
    def __init__(self):
        self.lengths = []

    def after_run(self, run_context, run_values):
        self.lengths.append(len(run_context.steps))


def test_train_switches_to_the_choice_and_logs_it_at_start_up(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(auto_loop, "choose", lambda lengths, **_: 5)  # as if measured
    x, y = h.make_data(n=64)
    est = h.make_estimator(tmp_path, ipl="auto", log_step_count_steps=20, save_summary_steps=20)
    assert est.config.tpu_config.iterations_per_loop == 20  # the bound the first loops run at
    seen = _Lengths()
    with caplog.at_level(logging.INFO, logger="estimator"):
        est.train(h.train_input_fn(x, y), max_steps=300, hooks=[seen])
    # the loops staged before the choice keep the bound; then loops of 5, to step 300
    assert seen.lengths[:2] == [20, 20] and set(seen.lengths[-10:]) == {5}
    assert sum(seen.lengths) == 300
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Training on")]
    assert "; iterations_per_loop auto: 5 (measured " in line
    # a later call keeps the choice: every loop of 5 from the start
    again = _Lengths()
    with caplog.at_level(logging.INFO, logger="estimator"):
        est.train(h.train_input_fn(x, y), steps=10, hooks=[again])
    assert again.lengths == [5, 5]
    assert "iterations_per_loop auto: 5 (chosen by an earlier train call)" in caplog.text
