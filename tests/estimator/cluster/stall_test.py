"""A stuck process ends a two-process job (issue 38), tested with real processes.

Process 1's training input_fn blocks for ever before its batch 12 (``threading.Event().wait()``)
while its heartbeat thread goes on, so only the progress watchdog can see it. With
``TPU_ESTIMATOR_STALL_TIMEOUT=6`` both processes must exit with code 75 within the stall
timeout + 60 s, each logging one error that names process 1, its phase ("input") and the last
committed checkpoint; restarting both (no stall) must resume and end with the parameters of a
run that never stalled, bit for bit. Every child runs under a deadline, so nothing here can
hang.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np
import pytest

from estimator.cluster import launch, watchdog
from estimator.io.checkpoint_read import read_variables
from tests.estimator import _multihost_job as job

JOB = [sys.executable, "-m", "tests.estimator._stall_job"]
TIMEOUTS = {"initialization_timeout": 120, "heartbeat_timeout": 8, "shutdown_timeout": 10}
STALL_TIMEOUT = 6  # seconds; short, yet above a loaded machine's longest pause between phases
STALL_AT = 12  # process 1's input_fn blocks before this batch: after the step-9 checkpoint
RUN_TIMEOUT = 240  # seconds for one two-process run, start-up and compilation included


def _start(root, name: str, model_dir: str, *extra: str):
    env = dict(os.environ, **{watchdog.STALL_TIMEOUT_ENV: str(STALL_TIMEOUT)})
    return launch.start_local(
        2,
        [model_dir, *extra],
        command=JOB,
        log_dir=str(root / name),
        timeouts=TIMEOUTS,
        base_env=env,
    )


def _logs(root, name: str) -> list[str]:
    return [(root / name / f"process_{i}.log").read_text() for i in (0, 1)]


def _wait_for_stall(procs, log_path) -> float:
    """When process 1 printed STALL (its input_fn is blocked from then on)."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while "STALL" not in log_path.read_text():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            launch.kill_all(procs)
            pytest.fail(f"no STALL from process 1 (exit codes {[p.poll() for p in procs]})")
        time.sleep(0.1)
    return time.monotonic()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The stalled run, its restart, and the reference run that never stalled."""
    root = tmp_path_factory.mktemp("stall")
    model_dir, reference_dir = str(root / "model"), str(root / "reference")
    stalled = _start(root, "stalled", model_dir, "--stall_at", str(STALL_AT))
    try:
        stalled_at = _wait_for_stall(stalled, root / "stalled" / "process_1.log")
        deadline = stalled_at + STALL_TIMEOUT + 60
        while any(p.poll() is None for p in stalled) and time.monotonic() < deadline:
            time.sleep(0.1)
        ended_after = time.monotonic() - stalled_at
        codes = [p.poll() for p in stalled]
    finally:
        launch.kill_all(stalled)
    restart = _start(root, "restart", model_dir)
    restart_rc = launch.wait_all(restart, timeout=RUN_TIMEOUT, grace=20)
    reference = _start(root, "reference", reference_dir)
    reference_rc = launch.wait_all(reference, timeout=RUN_TIMEOUT, grace=20)
    return {
        "model_dir": model_dir,
        "reference_dir": reference_dir,
        "codes": codes,
        "ended_after": ended_after,
        "stuck_pid": stalled[1].pid,
        "logs": _logs(root, "stalled"),
        "restart_rc": restart_rc,
        "restart_logs": _logs(root, "restart"),
        "reference_rc": reference_rc,
        "reference_logs": _logs(root, "reference"),
    }


def test_every_process_exits_75_in_time_naming_the_stuck_one(runs):
    logs = "\n".join(log[-3000:] for log in runs["logs"])
    assert runs["codes"] == [watchdog.HOST_LOST_EXIT_CODE] * 2, logs
    assert runs["ended_after"] < STALL_TIMEOUT + 60, logs
    checkpoint = os.path.join(runs["model_dir"], f"model.ckpt-{job.SAVE_EVERY}")
    for i, log in enumerate(runs["logs"]):
        errors = [ln for ln in log.splitlines() if ln.startswith("ERROR:")]
        assert len(errors) == 1, log[-3000:]
        (error,) = errors
        host = socket.gethostname()
        assert f"Process 1 (host {host}, pid {runs['stuck_pid']}) is stuck" in error
        assert f"no progress for {STALL_TIMEOUT} s (stall_timeout) in phase 'input'" in error
        assert f"Last committed checkpoint: {checkpoint}." in error
        assert error.endswith(f"Process {i} exits with code 75.")
        assert "Lost process" not in log and "Check failure" not in log


def test_the_restart_resumes_bitwise_equal_to_a_run_that_never_stalled(runs):
    assert runs["restart_rc"] == 0, "\n".join(log[-3000:] for log in runs["restart_logs"])
    assert runs["reference_rc"] == 0, "\n".join(log[-3000:] for log in runs["reference_logs"])
    for log in runs["restart_logs"]:
        assert f"Restored checkpoint {runs['model_dir']}/model.ckpt-{job.SAVE_EVERY}" in log
        assert "DONE" in log
    got = read_variables(runs["model_dir"])
    want = read_variables(runs["reference_dir"])
    assert sorted(got) == sorted(want) and int(got["global_step"]) == job.MAX_STEPS
    for name, value in want.items():
        a, b = np.asarray(got[name]), np.asarray(value)
        assert a.dtype == b.dtype and np.array_equal(a, b), name  # bit for bit
