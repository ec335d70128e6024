"""Tests for hooks.LoggingTensorHook: exact per-step cadence across loops."""

import logging
import re

import numpy as np
import pytest

import hooks
from tests.hooks._fakes import FakeClock, FakeSession, default_values, run_loops, use_clock


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "estimator"]


def test_every_n_iter_logs_exact_steps_across_loops(caplog):
    caplog.set_level(logging.INFO, logger="estimator")
    hook = hooks.LoggingTensorHook({"step": "global_step", "loss": "loss"}, every_n_iter=3)
    clock = FakeClock()
    use_clock(clock, hook)
    # 13 steps in loops of 5, 5, 3 (the last one shortened, as the estimator does).
    run_loops([hook], FakeSession(), [5, 5, 3], default_values, clock=clock, secs_per_step=0.2)
    lines = _lines(caplog)
    assert [int(re.search(r"step = (\d+)", line).group(1)) for line in lines] == [3, 6, 9, 12]
    # The values are those OF each step, not of the loop's last step; tags sorted.
    assert lines[0] == "loss = 0.75, step = 3"
    assert lines[1] == "loss = 1.5, step = 6 (0.600 sec)"
    assert lines[3] == "loss = 3.0, step = 12 (0.600 sec)"


def test_every_n_iter_skips_fetch_for_loops_without_due_step():
    hook = hooks.LoggingTensorHook(["loss"], every_n_iter=10)
    hook.begin()
    assert hook.before_run(hooks.SessionRunContext(None, None, steps=[1, 2, 3])) is None
    args = hook.before_run(hooks.SessionRunContext(None, None, steps=[9, 10, 11]))
    assert args.fetches == {"loss": "loss"}


def test_list_keeps_order_and_formatter(caplog):
    caplog.set_level(logging.INFO, logger="estimator")
    hook = hooks.LoggingTensorHook(["loss", "global_step"], every_n_iter=2)
    run_loops([hook], FakeSession(), [2], default_values)
    assert _lines(caplog) == ["loss = 0.5, global_step = 2"]
    caplog.clear()
    hook = hooks.LoggingTensorHook(
        {"l": "loss"}, every_n_iter=1, formatter=lambda v: f"custom {v['l']:.1f}"
    )
    run_loops([hook], FakeSession(), [2], default_values)
    assert _lines(caplog) == ["custom 0.2", "custom 0.5"]


def test_at_end_only(caplog):
    caplog.set_level(logging.INFO, logger="estimator")
    hook = hooks.LoggingTensorHook({"loss": "loss"}, at_end=True)
    run_loops([hook], FakeSession(), [4, 4, 2], default_values)
    assert _lines(caplog) == ["loss = 2.5"]


def test_at_end_without_runs_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="estimator")
    hook = hooks.LoggingTensorHook({"loss": "loss"}, at_end=True)
    run_loops([hook], FakeSession(), [], default_values)
    assert _lines(caplog) == []


def test_every_n_secs(caplog):
    caplog.set_level(logging.INFO, logger="estimator")
    hook = hooks.LoggingTensorHook(["global_step"], every_n_secs=1.0)
    clock = FakeClock()
    use_clock(clock, hook)
    # 0.25 s per step: the first step is logged, then one step per simulated second.
    run_loops([hook], FakeSession(), [6, 6], default_values, clock=clock, secs_per_step=0.25)
    assert _lines(caplog) == [
        "global_step = 1",
        "global_step = 5 (1.000 sec)",
        "global_step = 9 (1.000 sec)",
    ]


def test_array_values_and_fallback_counter(caplog):
    caplog.set_level(logging.INFO, logger="estimator")
    hook = hooks.LoggingTensorHook({"x": "x"}, every_n_iter=2)
    hook.begin()
    ctx = hooks.SessionRunContext(None, None)  # no steps given: counts steps itself
    hook.before_run(ctx)
    hook.after_run(ctx, hooks.SessionRunValues({"x": np.array([[1, 2], [3, 4], [5, 6]])}))
    assert _lines(caplog) == ["x = [3 4]"]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"every_n_iter": 1, "every_n_secs": 1}, {"every_n_iter": 0}, {"at_end": False}],
)
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        hooks.LoggingTensorHook(["loss"], **kwargs)
