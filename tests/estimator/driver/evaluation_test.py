"""The eval driver on a ``Job`` of real pieces (one device): hooks see each loop of
``iterations_per_loop`` steps with exactly its steps, however the calls ran them (several
loops merged into one call, an input ending inside a call, ``steps=`` ending inside a loop),
and every example is counted once (against numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from estimator.driver.evaluation import run_eval_loops
from estimator.driver.training import run_train_loops
from estimator.io.checkpoint_read import read_variables
from tests import helpers as h

from .jobs import Recorder, events, make_job

X, Y = h.make_data(96)
EX, EY = h.make_data(172, seed=1)  # 21 full batches of 8 and one of 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A checkpoint at step 2 to evaluate."""
    path = tmp_path_factory.mktemp("trained")
    job = make_job(path, ipl=2)
    run_train_loops(
        job, h.train_input_fn(X, Y), hooks=[], steps=None, max_steps=2, saving_listeners=[]
    )
    return path


def _reference(model_dir, rows: int) -> dict:
    """Loss and accuracy of the first ``rows`` eval examples, in numpy, from the checkpoint."""
    saved = read_variables(str(model_dir))
    w1, b1, w2, b2 = (saved[n] for n in ("hidden/kernel", "hidden/bias", "out/kernel", "out/bias"))
    x, y = EX[:rows], EY[:rows]
    logits = np.maximum(x @ w1 + b1, 0) @ w2 + b2
    logits = logits - logits.max(-1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return {
        "loss": float(-log_p[np.arange(rows), y].mean()),
        "accuracy": float((logits.argmax(-1) == y).mean()),
    }


def _evaluate(model_dir, *, ipl: int, steps=None, rows: int = len(EX)):
    job = make_job(model_dir, ipl=ipl)
    log: list = []
    results = run_eval_loops(
        job,
        h.eval_input_fn(EX[:rows], EY[:rows]),
        steps=steps,
        hooks=[Recorder("a", log)],
        checkpoint_path=None,
        name=None,
    )
    return job, results, log


def _loops(first: int, last: int, ipl: int) -> list[list[int]]:
    return [list(range(a, min(a + ipl, last + 1))) for a in range(first, last + 1, ipl)]


def _check(job, results, rows):
    want = _reference(job.model_dir, rows)
    assert results["global_step"] == 2
    np.testing.assert_allclose(results["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(results["accuracy"], want["accuracy"], rtol=1e-6)


def test_an_input_ending_inside_a_merged_call_gives_each_loop_its_steps(model_dir):
    # IPL 2: calls of 8 merged loops (16 steps); the input's 22 steps end inside the second.
    job, results, log = _evaluate(model_dir, ipl=2)
    loops = _loops(1, 22, 2)
    assert events(log, "a", "before_run") == loops
    assert events(log, "a", "after_run") == [(steps, len(steps)) for steps in loops]
    assert [e for _, e, _ in log][:2] == ["begin", "after_create_session"]
    assert events(log, "a", "end") == [2]
    _check(job, results, len(EX))


def test_an_input_ending_inside_a_loop_shows_the_planned_and_the_run_steps(model_dir):
    job, results, log = _evaluate(model_dir, ipl=4, rows=8 * 9 + 3)  # 10 steps, loops of 4
    assert events(log, "a", "before_run") == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert events(log, "a", "after_run") == [
        ([1, 2, 3, 4], 4),
        ([5, 6, 7, 8], 4),
        ([9, 10], 2),
    ]
    _check(job, results, 8 * 9 + 3)


@pytest.mark.parametrize("ipl, steps", [(2, 19), (4, 5)])
def test_steps_ending_inside_a_loop_plans_that_loop_short(model_dir, ipl, steps):
    job, results, log = _evaluate(model_dir, ipl=ipl, steps=steps)
    loops = _loops(1, steps, ipl)
    assert events(log, "a", "before_run") == loops
    assert events(log, "a", "after_run") == [(s, len(s)) for s in loops]
    _check(job, results, 8 * steps)


def test_a_hook_stop_ends_evaluation_after_its_loop(model_dir):
    job = make_job(model_dir, ipl=2)
    log: list = []
    run_eval_loops(
        job,
        h.eval_input_fn(EX, EY),
        steps=None,
        hooks=[Recorder("a", log, stop_at=3)],
        checkpoint_path=None,
        name=None,
    )
    assert events(log, "a", "after_run") == [([1, 2], 2), ([3, 4], 2)]
