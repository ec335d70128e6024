"""Tests for the early-stopping hooks on real event files."""

import os

import pytest
from tensorboardX import SummaryWriter

import hooks
from tests.hooks._fakes import FakeClock, FakeSession, use_clock


class FakeEstimator:
    def __init__(self, model_dir):
        self.model_dir = model_dir

    def eval_dir(self, name=None):
        return os.path.join(self.model_dir, "eval" if not name else "eval_" + name)


def _train_and_evaluate(hook, estimator, metric_sequence, metric="accuracy", steps_per_round=100):
    """Plays train_and_evaluate: each round trains one loop, then writes an eval result.

    Returns the 1-based round after whose training loop the hook requested a stop (or None).
    """
    session = FakeSession(model_dir=estimator.model_dir)
    hook.begin()
    hook.after_create_session(session, None)
    for round_index, value in enumerate(metric_sequence, start=1):
        steps = range(session.global_step + 1, session.global_step + steps_per_round + 1)
        ctx = hooks.SessionRunContext(None, session, steps=steps)
        hook.before_run(ctx)
        session.global_step += steps_per_round
        hook.after_run(ctx, hooks.SessionRunValues(None))
        if ctx.stop_requested:
            hook.end(session)
            return round_index
        # One writer per evaluation, closed so its queue is on disk (flush() does not
        # drain tensorboardX's queue), with a distinct suffix so files of the same second
        # do not overwrite each other.
        suffix = f".{round_index:04d}"
        with SummaryWriter(estimator.eval_dir(), filename_suffix=suffix) as writer:
            writer.add_scalar(metric, value, session.global_step)
            writer.add_scalar("loss", 1.0 - value, session.global_step)
    hook.end(session)
    return None


ACCURACY = [0.5, 0.6, 0.7, 0.65, 0.68, 0.69, 0.72, 0.7, 0.7, 0.7, 0.7]


@pytest.mark.parametrize(
    "make_hook, expected_round",
    [
        # Round k's check sees the evals of rounds 1..k-1 (at steps 100..100(k-1)).
        # 0.72 is written after round 7.
        (lambda est: hooks.stop_if_higher_hook(est, "accuracy", 0.71, run_every_secs=0.0), 8),
        (lambda est: hooks.stop_if_lower_hook(est, "loss", 0.285, run_every_secs=0.0), 8),
        (lambda est: hooks.stop_if_higher_hook(est, "accuracy", 0.99, run_every_secs=0.0), None),
        # Best 0.7 at step 300; step 600 is 300 steps later -> stops at round 7.
        (lambda est: hooks.stop_if_no_increase_hook(est, "accuracy", 300, run_every_secs=0.0), 7),
        # Best 0.72 at step 700; 300 steps later is step 1000 -> round 11.
        (
            lambda est: hooks.stop_if_no_increase_hook(
                est, "accuracy", 300, min_steps=600, run_every_secs=0.0
            ),
            11,
        ),
        (lambda est: hooks.stop_if_no_decrease_hook(est, "loss", 300, run_every_secs=0.0), 7),
        # Checking only every 300 steps: checks at steps 100, 400, 700 (sees step 600), ...
        (
            lambda est: hooks.stop_if_no_increase_hook(
                est, "accuracy", 300, run_every_secs=None, run_every_steps=300
            ),
            7,
        ),
        # run_every_steps takes precedence over the default run_every_secs=60.
        # Checks at steps 100, 300, 500, 700, 900 (sees step 700's 0.72).
        (lambda est: hooks.stop_if_higher_hook(est, "accuracy", 0.71, run_every_steps=200), 9),
    ],
)
def test_stops_at_expected_round(tmp_path, make_hook, expected_round):
    estimator = FakeEstimator(str(tmp_path))
    hook = make_hook(estimator)
    assert _train_and_evaluate(hook, estimator, ACCURACY) == expected_round
    if expected_round is not None:
        assert hook.stopped_at_step == 100 * expected_round


def test_run_every_secs_limits_checks(tmp_path):
    calls = []
    hook = hooks.make_early_stopping_hook(None, lambda: calls.append(1) or False, run_every_secs=60)
    clock = FakeClock()
    use_clock(clock, hook)
    session = FakeSession()
    hook.begin()
    for _ in range(10):
        clock.advance(25)
        session.global_step += 1
        hook.after_run(hooks.SessionRunContext(None, session, steps=[session.global_step]), None)
    # t=25 (first), 100, 175, 250.
    assert len(calls) == 4


def test_explicit_eval_dir_and_model_dir_fallback(tmp_path):
    eval_dir = tmp_path / "custom"
    with SummaryWriter(str(eval_dir)) as writer:
        writer.add_scalar("accuracy", 0.9, 10)
    hook = hooks.stop_if_higher_hook(
        FakeEstimator("/nonexistent"), "accuracy", 0.5, eval_dir=str(eval_dir), run_every_secs=1
    )
    ctx = hooks.SessionRunContext(None, FakeSession(), steps=[11])
    hook.after_run(ctx, None)
    assert ctx.stop_requested

    class ModelDirOnly:
        model_dir = str(tmp_path)

    with SummaryWriter(str(tmp_path / "eval")) as writer:
        writer.add_scalar("accuracy", 0.9, 10)
    hook = hooks.stop_if_higher_hook(ModelDirOnly(), "accuracy", 0.5, run_every_secs=1)
    ctx = hooks.SessionRunContext(None, FakeSession(), steps=[11])
    hook.after_run(ctx, None)
    assert ctx.stop_requested


def test_missing_metric_is_an_error(tmp_path):
    estimator = FakeEstimator(str(tmp_path))
    with SummaryWriter(estimator.eval_dir()) as writer:
        writer.add_scalar("accuracy", 0.9, 10)
    hook = hooks.stop_if_higher_hook(estimator, "acuracy", 0.5, run_every_secs=1)
    with pytest.raises(ValueError, match=r"acuracy.*found: \['accuracy'\]"):
        hook.after_run(hooks.SessionRunContext(None, FakeSession(), steps=[11]), None)


def test_no_eval_results_yet_does_not_stop(tmp_path):
    hook = hooks.stop_if_no_decrease_hook(FakeEstimator(str(tmp_path)), "loss", 1, run_every_secs=1)
    ctx = hooks.SessionRunContext(None, FakeSession(), steps=[1])
    hook.after_run(ctx, None)
    assert not ctx.stop_requested


def test_invalid_arguments():
    with pytest.raises(TypeError):
        hooks.make_early_stopping_hook(None, "not callable")
    with pytest.raises(ValueError):
        hooks.make_early_stopping_hook(None, lambda: False, run_every_secs=None)
