"""What the drivers work with (``driver/job.py``): the ``Job``'s derived values, and the
reasons a ``train`` call ends."""

from __future__ import annotations

import dataclasses
import doctest
import os

import pytest

from estimator.driver import job as job_lib
from estimator.driver.job import EndReason, TrainOutcome
from estimator.parallel.mesh import make_mesh
from tests.estimator.driver import jobs


def test_job_names_its_directories_and_replicas(tmp_path):
    job = jobs.make_job(tmp_path)
    assert job.model_dir == str(tmp_path)
    assert job.num_replicas == 1  # one device
    assert job.eval_dir() == os.path.join(str(tmp_path), "eval")
    assert job.eval_dir("") == os.path.join(str(tmp_path), "eval")
    assert job.eval_dir("holdout") == os.path.join(str(tmp_path), "eval_holdout")
    assert dataclasses.replace(job, mesh=make_mesh()).num_replicas == 8


def test_job_is_frozen(tmp_path):
    job = jobs.make_job(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.mesh = None


@pytest.mark.parametrize(
    "reason, text",
    [
        (EndReason.TARGET, "target"),
        (EndReason.HOOK, "hook"),
        (EndReason.LISTENER, "listener"),
        (EndReason.INPUT_END, "input_end"),
        (EndReason.SIGNAL, "signal"),
        (EndReason.ALREADY_DONE, "already_done"),
    ],
)
def test_end_reasons_compare_as_strings(reason, text):
    assert reason == text and EndReason(text) is reason
    outcome = TrainOutcome(12, reason)
    assert outcome.step == 12 and outcome.reason == text


def test_every_end_reason_is_listed():
    assert len(EndReason) == 6


def test_docstring_examples():
    assert doctest.testmod(job_lib).failed == 0
