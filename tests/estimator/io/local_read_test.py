"""Reading checkpoints from one process of a many-process job, without the others: each
process alone reads what a single process reads, and nobody waits at a barrier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

import estimator
from estimator.cluster import launch
from estimator.io import local_read
from estimator.io.checkpoint_read import read_variables
from tests.estimator import _tf_style_job as job

TIMEOUTS = {"initialization_timeout": 60, "heartbeat_timeout": 8, "shutdown_timeout": 30}


def test_reader_options_are_this_process_alone():
    options = local_read.process_local_options()
    assert options.active_processes == {0} and options.primary_host == 0


def test_the_process_index_is_known_without_starting_jax():
    """Reading before the estimator is built must not start the backend (the process could
    then no longer join its job)."""
    code = (
        "from estimator.io import local_read\n"
        "from jax._src import xla_bridge\n"
        "print(local_read.process_index(), xla_bridge.backends_are_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["0", "False"], out.stderr[-2000:]


def _run_two_processes(tmp_path, *args: str) -> tuple[int, float, list[str]]:
    """The TF-style script as two processes (4 CPU devices each) of one job."""
    model_dir, out_dir = str(tmp_path / "model"), str(tmp_path / "out")
    os.makedirs(out_dir)
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    start = time.monotonic()
    procs = launch.start_local(
        2,
        [model_dir, out_dir, *args],
        command=[sys.executable, job.__file__],
        log_dir=str(tmp_path / "logs"),
        timeouts=TIMEOUTS,
        base_env=env,
    )
    rc = launch.wait_all(procs, timeout=150, grace=20)
    logs = [(tmp_path / "logs" / f"process_{i}.log").read_text() for i in (0, 1)]
    return rc, time.monotonic() - start, logs


def test_each_process_alone_reads_what_one_process_reads(tmp_path):
    """After a joint ``train``, process 0 reads every variable and checkpoint fact while
    process 1 waits on a file (no collective), then process 1 reads alone while process 0
    is leaving; both exit 0, and each read took well under a barrier's timeout."""
    rc, secs, logs = _run_two_processes(tmp_path, "--readers", "0,1")
    assert rc == 0, "\n".join(log[-3000:] for log in logs)
    model_dir = str(tmp_path / "model")
    want_values = read_variables(model_dir)  # this (one) process's read
    want_latest = os.path.join(model_dir, "model.ckpt-6")
    for i in (0, 1):
        got = json.loads((tmp_path / "out" / f"process_{i}.json").read_text())
        assert got["process_count"] == 2 and got["read_secs"] < 10, got
        read = got["read"]
        assert read["names"] == sorted(want_values)
        for name, value in want_values.items():
            np.testing.assert_array_equal(read["values"][name], value, err_msg=name)
        assert read["latest"] == read["module_latest"] == read["iterated"] == want_latest
        assert read["list_variables"] == [list(v) for v in estimator.list_variables(model_dir)]
        np.testing.assert_array_equal(read["load_variable"], want_values["out/bias"])
    assert "Barrier" not in logs[0] + logs[1]
    assert secs < 120, f"took {secs:.0f} s"
