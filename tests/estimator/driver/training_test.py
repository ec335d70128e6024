"""The train driver on a ``Job`` of real pieces (one device): why each call ends, the order
hooks are called in, and the input reopened when an older checkpoint is restored."""

from __future__ import annotations

import logging
import os
import signal

import jax
import numpy as np
import pytest

import estimator
import hooks as hooks_lib
from estimator.core.spec import ModeKeys
from estimator.driver.job import EndReason, TrainOutcome
from estimator.driver.training import run_train_loops
from tests import helpers as h

from .jobs import Recorder, events, make_job

X, Y = h.make_data(96)


def _train(job, input_fn=None, *, hooks=(), steps=None, max_steps=None, listeners=()):
    return run_train_loops(
        job,
        input_fn or h.train_input_fn(X, Y),
        hooks=list(hooks),
        steps=steps,
        max_steps=max_steps,
        saving_listeners=list(listeners),
    )


def _batches(n: int, b: int = 8):
    """Exactly ``n`` full batches."""

    def input_fn(params):
        for i in range(n):
            j = i * b % len(X)
            yield {"x": X[j : j + b]}, Y[j : j + b]

    return input_fn


def _end_lines(caplog) -> list[str]:
    return [
        m
        for m in caplog.messages
        if m.startswith(("Training stopped", "Input ended", "Skipping training"))
    ]


def _params(job) -> dict:
    """The last trained parameters by path (``hidden/kernel``)."""
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(job.store.last.state.params))[0]
    return {jax.tree_util.keystr(path): np.asarray(v) for path, v in flat}


# ----------------------------------------------------------------------------- end reasons
def test_max_steps_ends_at_the_target_and_says_so_once(tmp_path, caplog):
    job = make_job(tmp_path, ipl=4)
    with caplog.at_level(logging.INFO, logger="estimator"):
        outcome = _train(job, max_steps=6)
    assert outcome == TrainOutcome(6, EndReason.TARGET)
    assert _end_lines(caplog) == ["Training stopped at global step 6: max_steps=6 reached."]


def test_an_input_exactly_as_long_as_max_steps_still_ends_at_the_target(tmp_path, caplog):
    job = make_job(tmp_path, ipl=4)
    with caplog.at_level(logging.INFO, logger="estimator"):
        outcome = _train(job, _batches(6), max_steps=6)
    assert outcome.reason is EndReason.TARGET and outcome.step == 6
    assert _end_lines(caplog) == ["Training stopped at global step 6: max_steps=6 reached."]


def _trained_to_6(tmp_path, caplog):
    """A job whose checkpoint is at step 6, the log lines of that first call dropped."""
    job = make_job(tmp_path, ipl=4)
    _train(job, max_steps=6)
    caplog.clear()  # the first call's lines, if an earlier test left the logger at INFO
    return job


def test_steps_counts_from_the_checkpoint_and_names_itself(tmp_path, caplog):
    job = _trained_to_6(tmp_path, caplog)
    log: list = []
    with caplog.at_level(logging.INFO, logger="estimator"):
        outcome = _train(job, hooks=[Recorder("a", log)], steps=3)
    assert outcome == TrainOutcome(9, EndReason.TARGET)
    assert events(log, "a", "after_create_session") == [6]
    assert events(log, "a", "before_run") == [[7, 8, 9]]
    assert _end_lines(caplog) == ["Training stopped at global step 9: steps=3 reached."]


def test_nothing_to_do_runs_no_hook(tmp_path, caplog):
    job = _trained_to_6(tmp_path, caplog)
    log: list = []
    with caplog.at_level(logging.INFO, logger="estimator"):
        outcome = _train(job, hooks=[Recorder("a", log)], max_steps=6)
        # A hook's planned last step already behind the checkpoint: nothing to do either.
        past = _train(job, hooks=[hooks_lib.StopAtStepHook(last_step=4)])
    assert outcome == TrainOutcome(6, EndReason.ALREADY_DONE) == past
    assert log == []
    assert _end_lines(caplog) == [
        "Skipping training since max_steps has already saved (step 6; max_steps 6).",
        "Skipping training since a hook's planned last step 4 is already reached (step 6).",
    ]


def test_a_hook_that_requests_a_stop_ends_the_call_at_its_loop(tmp_path, caplog):
    job = make_job(tmp_path, ipl=2)
    log: list = []
    with caplog.at_level(logging.INFO, logger="estimator"):
        outcome = _train(job, hooks=[Recorder("a", log, stop_at=3)], max_steps=100)
    assert outcome == TrainOutcome(4, EndReason.HOOK)
    assert events(log, "a", "end") == [4]
    assert job.store.writer().steps() == [4]  # the final checkpoint is written
    assert _end_lines(caplog) == ["Training stopped at global step 4: a hook requested a stop."]


def test_a_saving_listener_that_returns_true_ends_the_call(tmp_path, caplog):
    class StopAfterFirstSave(hooks_lib.CheckpointSaverListener):
        def after_save(self, session, global_step_value):
            return True

    job = make_job(tmp_path, ipl=2, save_checkpoints_steps=2)
    with caplog.at_level(logging.INFO, logger="estimator"):
        outcome = _train(job, max_steps=100, listeners=[StopAfterFirstSave()])
    assert outcome == TrainOutcome(2, EndReason.LISTENER)
    assert _end_lines(caplog) == [
        "Training stopped at global step 2: a saving listener requested a stop."
    ]


def test_an_input_that_ends_inside_a_loop_runs_its_real_steps_and_warns(tmp_path, caplog):
    job = make_job(tmp_path, ipl=2)
    log: list = []
    with caplog.at_level(logging.INFO, logger="estimator"):
        outcome = _train(job, _batches(5), hooks=[Recorder("a", log)], max_steps=100)
    assert outcome == TrainOutcome(5, EndReason.INPUT_END)
    assert events(log, "a", "before_run") == [[1, 2], [3, 4], [5, 6]]  # as planned
    assert events(log, "a", "after_run") == [([1, 2], 2), ([3, 4], 2), ([5], 1)]  # as run
    assert _end_lines(caplog) == ["Input ended at global step 5: max_steps = 100 was not reached."]


def test_an_input_that_ends_with_no_target_is_an_info_line(tmp_path, caplog):
    job = make_job(tmp_path, ipl=2)
    with caplog.at_level(logging.INFO, logger="estimator"):
        outcome = _train(job, _batches(3))
    assert outcome == TrainOutcome(3, EndReason.INPUT_END)
    assert [r.levelname for r in caplog.records if r.getMessage().startswith("Input ended")] == [
        "INFO"
    ]


def test_sigterm_stops_at_the_loop_saves_and_raises_preempted(tmp_path, caplog):
    def sigterm_after(steps):
        if steps[-1] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # StopSignals (driver/preemption.py) records it

    job = make_job(tmp_path, ipl=2)
    log: list = []
    with caplog.at_level(logging.INFO, logger="estimator"):
        with pytest.raises(estimator.Preempted) as info:
            _train(job, hooks=[Recorder("a", log, on_after_run=sigterm_after)], max_steps=100)
    assert info.value.global_step == 2 and job.store.writer().steps() == [2]
    assert events(log, "a", "end") == [2]
    assert _end_lines(caplog) == ["Training stopped at global step 2: SIGTERM."]


# ----------------------------------------------------------------------------- hook order
def test_hooks_are_called_in_lifecycle_order_spec_hooks_before_the_users(tmp_path):
    log: list = []

    def model_fn(features, labels, mode, params):
        spec = h.model_fn(features, labels, mode, params)
        if mode == ModeKeys.TRAIN:
            spec.training_hooks = (Recorder("spec", log),)
        return spec

    job = make_job(tmp_path, model_fn=model_fn, ipl=4)
    outcome = _train(job, hooks=[Recorder("a", log), Recorder("b", log)], max_steps=6)
    assert outcome == TrainOutcome(6, EndReason.TARGET)
    order = ["spec", "a", "b"]
    per_loop = [(n, "before_run") for n in order] + [(n, "after_run") for n in order]
    assert [(n, e) for n, e, _ in log] == (
        [(n, "begin") for n in order]
        + [(n, "after_create_session") for n in order]
        + per_loop * 2
        + [(n, "end") for n in order]
    )
    assert events(log, "a", "after_create_session") == [0]
    assert events(log, "a", "before_run") == [[1, 2, 3, 4], [5, 6]]
    assert events(log, "a", "after_run") == [([1, 2, 3, 4], 4), ([5, 6], 2)]
    assert events(log, "b", "end") == [6]


# ----------------------------------------------------------------------------- resume
def test_resuming_from_an_older_checkpoint_reopens_the_input_at_its_position(tmp_path):
    opened = []

    def input_fn(params):
        opened.append(1)
        yield from h.train_input_fn(X, Y)(params)

    model_dir = tmp_path / "run"
    _train(make_job(model_dir, ipl=2, save_checkpoints_steps=2), input_fn, max_steps=4)
    assert len(opened) == 1
    # Step 4 unreadable: step 2 is restored, and the input must be where step 2 left it.
    (model_dir / "model.ckpt-4" / "variables" / "manifest.ocdbt").write_bytes(b"\x00garbage")
    job = make_job(model_dir, ipl=2, save_checkpoints_steps=2)
    log: list = []
    outcome = _train(job, input_fn, hooks=[Recorder("a", log)], max_steps=6)
    assert outcome == TrainOutcome(6, EndReason.TARGET)
    assert len(opened) == 3  # opened at step 4's position, then reopened at step 2's
    assert events(log, "a", "after_create_session") == [2]
    assert events(log, "a", "before_run") == [[3, 4], [5, 6]]

    reference = make_job(tmp_path / "reference", ipl=2)  # one uninterrupted run
    _train(reference, max_steps=6)
    h.assert_params_close(_params(job), _params(reference), rtol=1e-6, atol=1e-7)
