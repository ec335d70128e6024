"""Tests for hooks.NanTensorHook: every step checked, first bad step named."""

import logging

import numpy as np
import pytest

import hooks
from tests.hooks._fakes import FakeSession, run_loops


def _values_with(bad_step, bad_value):
    def values(steps):
        loss = np.ones(len(steps), np.float32)
        loss[steps == bad_step] = bad_value
        loss[steps > bad_step] = np.nan  # later steps are bad too; the first one is named
        return {"loss": loss, "global_step": steps}

    return values


@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
def test_raises_naming_first_bad_step(bad_value):
    hook = hooks.NanTensorHook("loss")
    session = FakeSession()
    with pytest.raises(hooks.NanLossDuringTrainingError, match="at global step 7") as info:
        run_loops([hook], session, [5, 5, 5], _values_with(7, bad_value))
    assert info.value.global_step == 7 and hook.nan_step == 7
    assert session.saves == []


def test_request_stop_mode(caplog):
    hook = hooks.NanTensorHook("loss", fail_on_nan_loss=False)
    session = FakeSession()
    loops = run_loops([hook], session, [4] * 5, _values_with(6, np.nan))
    assert loops == 2 and hook.nan_step == 6
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "estimator"]
    assert len(errors) == 1 and "global step 6" in errors[0].getMessage()


def test_finite_losses_pass():
    hook = hooks.NanTensorHook()
    assert run_loops([hook], FakeSession(), [4, 4], _values_with(100, np.nan)) == 2
    assert hook.nan_step is None


def test_per_example_values_and_no_steps():
    hook = hooks.NanTensorHook("per_example")
    ctx = hooks.SessionRunContext(None, FakeSession(global_step=12))
    assert hook.before_run(ctx).fetches == "per_example"
    values = np.ones((3, 4))
    values[1, 2] = np.nan
    with pytest.raises(hooks.NanLossDuringTrainingError, match="at global step 11"):
        hook.after_run(ctx, hooks.SessionRunValues(values))
