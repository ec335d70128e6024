"""The standard hooks together, driven the way the estimator drives them in training."""

import logging

import numpy as np
import pytest

import hooks
from tests.hooks._fakes import FakeClock, FakeSession, run_loops, use_clock


def _training_hooks(session, clock):
    stop = hooks.StopAtStepHook(num_steps=20)
    saver = hooks.CheckpointSaverHook(session.model_dir, save_steps=8)
    logger = hooks.LoggingTensorHook({"loss": "loss", "step": "global_step"}, every_n_iter=5)
    counter = hooks.StepCounterHook(every_n_steps=5)
    nan = hooks.NanTensorHook("loss")
    all_hooks = [nan, logger, counter, stop, saver]
    use_clock(clock, logger, counter, saver)
    return all_hooks, stop, counter


def test_default_training_hooks_together(caplog):
    caplog.set_level(logging.INFO, logger="estimator")
    session = FakeSession(global_step=2)
    clock = FakeClock()
    all_hooks, stop, counter = _training_hooks(session, clock)
    # The estimator shortens the last loop to land on stop.last_step (resolved to 22).
    for hook in all_hooks:
        hook.begin()
    for hook in all_hooks:
        hook.after_create_session(session, None)
    assert stop.last_step == 22
    sizes = []
    step = session.global_step
    while step < stop.last_step:
        sizes.append(min(6, stop.last_step - step))
        step += sizes[-1]
    assert sizes == [6, 6, 6, 2]

    def values(steps):
        return {"loss": 1.0 / steps.astype(np.float32), "global_step": steps}

    # run_loops calls begin/after_create_session again, which must be harmless.
    loops = run_loops(
        all_hooks, session, sizes, values, clock=clock, secs_per_step=0.1, examples_per_step=16
    )
    assert loops == 4 and session.global_step == 22
    assert session.saves == [14, 22]  # 8+ steps after the start (2), then the end
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loss")]
    assert [line.split("step = ")[1].split()[0] for line in logged] == ["5", "10", "15", "20"]
    assert counter.steps_per_sec == pytest.approx(10.0)
    assert counter.examples_per_sec == pytest.approx(160.0)


def test_nan_raises_before_the_save_of_that_loop():
    session = FakeSession()
    nan = hooks.NanTensorHook()
    saver = hooks.CheckpointSaverHook(session.model_dir, save_steps=4)

    def values(steps):
        loss = np.where(steps >= 10, np.nan, 1.0).astype(np.float32)
        return {"loss": loss, "global_step": steps}

    with pytest.raises(hooks.NanLossDuringTrainingError, match="global step 10"):
        run_loops([nan, saver], session, [4] * 5, values)
    assert session.saves == [4, 8]
