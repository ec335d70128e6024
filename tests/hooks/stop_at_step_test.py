"""Tests for hooks.StopAtStepHook."""

import numpy as np
import pytest

import hooks
from tests.hooks._fakes import FakeSession, default_values, run_loops


def test_last_step():
    hook = hooks.StopAtStepHook(last_step=7)
    assert hook.last_step == 7
    session = FakeSession()
    loops = run_loops([hook], session, [3] * 10, default_values)
    assert loops == 3 and session.global_step == 9  # the stop lands at the loop's end


def test_num_steps_counts_from_starting_step():
    hook = hooks.StopAtStepHook(num_steps=6)
    assert hook.last_step is None
    session = FakeSession(global_step=10)
    loops = run_loops([hook], session, [3] * 10, default_values)
    assert hook.last_step == 16
    assert loops == 2 and session.global_step == 16
    # A second session (another train() call) resolves num_steps again.
    run_loops([hook], session, [3] * 10, default_values)
    assert hook.last_step == 22 and session.global_step == 22


def test_without_context_steps_fetches_global_step():
    hook = hooks.StopAtStepHook(last_step=2)
    ctx = hooks.SessionRunContext(None, FakeSession())
    assert hook.before_run(ctx).fetches == "global_step"
    hook.after_run(ctx, hooks.SessionRunValues(default_values(np.arange(1, 3))["global_step"]))
    assert ctx.stop_requested


@pytest.mark.parametrize("kwargs", [{}, {"num_steps": 1, "last_step": 1}, {"num_steps": -1}])
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        hooks.StopAtStepHook(**kwargs)
