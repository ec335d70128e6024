"""Tests for hooks.CheckpointSaverHook and CheckpointSaverListener."""

import pytest

import hooks
from tests.hooks._fakes import FakeClock, FakeSession, default_values, run_loops, use_clock


class RecordingListener(hooks.CheckpointSaverListener):
    def __init__(self, stop_after=None):
        self.calls = []
        self.stop_after = stop_after

    def begin(self):
        self.calls.append(("begin",))

    def before_save(self, session, global_step_value):
        self.calls.append(("before_save", global_step_value, list(session.saves)))

    def after_save(self, session, global_step_value):
        self.calls.append(("after_save", global_step_value, list(session.saves)))
        return self.stop_after is not None and global_step_value >= self.stop_after

    def end(self, session, global_step_value):
        self.calls.append(("end", global_step_value))


def test_save_steps_cadence_with_loops_of_three():
    session = FakeSession()
    hook = hooks.CheckpointSaverHook(session.model_dir, save_steps=4)
    run_loops([hook], session, [3] * 7, default_values)
    # First boundary at least 4 steps after the previous save (TF's timer), then the end.
    assert session.saves == [6, 12, 18, 21]
    assert hook.last_saved_path.endswith("ckpt-21")


def test_save_steps_from_resumed_step_and_no_duplicate_end_save():
    session = FakeSession(global_step=100)
    hook = hooks.CheckpointSaverHook(session.model_dir, save_steps=5)
    run_loops([hook], session, [5, 5], default_values)
    assert session.saves == [105, 110]


def test_no_steps_no_save():
    session = FakeSession(global_step=3)
    hook = hooks.CheckpointSaverHook(session.model_dir, save_steps=1)
    run_loops([hook], session, [], default_values)
    assert session.saves == []


def test_save_secs():
    session = FakeSession()
    clock = FakeClock()
    hook = hooks.CheckpointSaverHook(session.model_dir, save_secs=10)
    use_clock(clock, hook)
    run_loops([hook], session, [2] * 6, default_values, clock=clock, secs_per_step=2.0)
    # Loops end at t=4, 8, 12, 16, 20, 24: saves at t=12 (step 6) and t=24 (step 12).
    assert session.saves == [6, 12]


def test_listeners_order_and_stop():
    session = FakeSession()
    listener = RecordingListener(stop_after=4)
    hook = hooks.CheckpointSaverHook(session.model_dir, save_steps=2, listeners=[listener])
    loops = run_loops([hook], session, [2] * 10, default_values)
    assert loops == 2  # the save at step 4 asked to stop
    assert listener.calls == [
        ("begin",),
        ("before_save", 2, []),
        ("after_save", 2, [2]),
        ("before_save", 4, [2]),
        ("after_save", 4, [2, 4]),
        ("end", 4),
    ]


def test_custom_saver():
    class Saver:
        def __init__(self):
            self.calls = []

        def save(self, session, save_path, global_step=None):
            self.calls.append((save_path, global_step))
            return f"{save_path}-{global_step}"

    saver = Saver()
    session = FakeSession()
    hook = hooks.CheckpointSaverHook("/ckpts", save_steps=3, saver=saver, checkpoint_basename="m")
    run_loops([hook], session, [3, 1], default_values)
    assert saver.calls == [("/ckpts/m", 3), ("/ckpts/m", 4)]
    assert session.saves == [] and hook.last_saved_path == "/ckpts/m-4"


def test_warns_when_checkpoint_dir_differs(caplog):
    hook = hooks.CheckpointSaverHook("/elsewhere", save_steps=3)
    run_loops([hook], FakeSession(), [1], default_values)
    assert any("not the estimator's model_dir" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"save_steps": 1, "save_secs": 1}, {"save_steps": 1, "saver": 1, "scaffold": 1}],
)
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        hooks.CheckpointSaverHook("/d", **kwargs)
