"""Process 0 lost (issue 42, item 4), tested with real processes.

Process 0 hosts JAX's coordination service. SIGKILLed, its sockets close at once and JAX's
agent in process 1 aborts within milliseconds (exit -6, a C++ stack, no estimator line)
unless the watchdog's SIGABRT guard turns that into exit 75 naming process 0; SIGSTOPped,
the service stops answering and the watchdog speaks after ``heartbeat_timeout``, before
JAX's own heartbeat timeout. Either way process 1 must exit 75 with one line naming process 0
and the last committed checkpoint. Every child runs under a deadline.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest

from estimator.cluster import launch, watchdog
from tests.estimator import _multihost_job as job

JOB = [sys.executable, "-m", "tests.estimator._multihost_job"]
TIMEOUTS = {"initialization_timeout": 120, "heartbeat_timeout": 8, "shutdown_timeout": 10}
RUN_TIMEOUT = 240  # seconds to reach the loop after the first checkpoint


def _wait_for(predicate, procs, what: str) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            launch.kill_all(procs)
            pytest.fail(f"{what}: not reached (exit codes {[p.poll() for p in procs]})")
        time.sleep(0.1)


@pytest.mark.parametrize(
    "sig, within, what",
    [
        ("SIGKILL", 15, "the coordination service it hosts closed its connections"),
        ("SIGSTOP", TIMEOUTS["heartbeat_timeout"] + 30, "stopped answering for 8 s"),
    ],
)
def test_losing_process_0_ends_process_1_with_75_naming_it(tmp_path, sig, within, what):
    model_dir, out_dir, logs = tmp_path / "model", tmp_path / "out", tmp_path / "logs"
    os.makedirs(out_dir)
    argv = ["--max_steps", "60", "--sleep", "2", "--sleep_from", str(job.SAVE_EVERY)]
    procs = launch.start_local(
        2,
        [str(model_dir), str(out_dir), *argv, "--train_only"],
        command=JOB,
        log_dir=str(logs),
        timeouts=TIMEOUTS,
    )
    try:
        _wait_for(
            lambda: (
                (model_dir / f"model.ckpt-{job.SAVE_EVERY}").is_dir()
                and "LOOP 12" in (logs / "process_1.log").read_text()
            ),
            procs,
            "the loop after the first checkpoint",
        )
        os.kill(procs[0].pid, getattr(signal, sig))
        lost_at = time.monotonic()
        deadline = lost_at + within + 30
        while procs[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        rc, secs = procs[1].poll(), time.monotonic() - lost_at
    finally:
        launch.kill_all(procs)
    log = (logs / "process_1.log").read_text()
    assert rc == watchdog.HOST_LOST_EXIT_CODE, log[-3000:]
    assert secs < within, (secs, log[-3000:])
    errors = [ln for ln in log.splitlines() if ln.startswith("ERROR:")]
    assert len(errors) == 1, log[-3000:]
    assert f"Lost process 0 (host {socket.gethostname()}, pid {procs[0].pid}): " in errors[0]
    assert what in errors[0], errors[0]
    checkpoint = os.path.join(model_dir, f"model.ckpt-{job.SAVE_EVERY}")
    assert f"Last committed checkpoint: {checkpoint}." in errors[0]
    assert errors[0].endswith("Process 1 exits with code 75.")
