"""Many hosts through jax.distributed, tested as two processes x 4 CPU devices on one machine.

The reference is the same job in this (one) process on 8 devices: same global batches, same
replicas, so the two-process job must end with the same parameters, eval results and
predictions. Every child process runs under a timeout, so nothing here can hang.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import estimator
import models
from estimator.cluster import launch, watchdog
from estimator.io.checkpoint_read import read_variables
from estimator.parallel import multihost
from models.datasets import shard_batches
from tests.estimator import _multihost_job as job

JOB = [sys.executable, "-m", "tests.estimator._multihost_job"]
TIMEOUTS = {"initialization_timeout": 120, "heartbeat_timeout": 8, "shutdown_timeout": 10}
RUN_TIMEOUT = 240  # seconds for one two-process run, start-up and compilation included


def test_launched_processes_form_one_job():
    """``python -m estimator.launch``: two children, 4 devices each, joined by
    ``TPUStrategy(TPUClusterResolver())`` into one 8-device job."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "estimator.cluster.launch",
            "--num_processes",
            "2",
            "--timeout",
            "120",
            "--",
            "-m",
            "tests.estimator._multihost_job",
            "--probe",
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if "PROBE " in ln]
    probes = sorted(
        (json.loads(ln.split("PROBE ", 1)[1]) for ln in lines), key=lambda p: p["process_index"]
    )
    assert [ln.startswith("[process 1] ") for ln in sorted(lines)] == [False, True]
    assert [
        (p["process_index"], p["process_count"], p["local_devices"], p["devices"]) for p in probes
    ] == [(0, 2, 4, 8), (1, 2, 4, 8)]
    for p in probes:
        assert [g["index"] for g in p["gathered"]] == [0, 1]
        assert p["broadcast"] == "from 0" and p["any_of"] == [True, False]
        assert p["after_error"] == {"value": 7} and p["replicas_in_sync"] == 8
    assert [p["remote_error"] for p in probes] == ["ZeroDivisionError", "RemoteError"]
    assert [p["worker_error"] for p in probes] == ["ZeroDivisionError", "RemoteError"]


def test_sharded_digits_input_is_the_one_process_input():
    fns = models.DATASETS["digits"](job.job_config())
    for name in ("train", "eval"):
        one = fns[name]({"batch_size": 112})
        parts = [fns[name]({"batch_size": 56}, estimator.InputContext(2, i, 8)) for i in (0, 1)]
        for _ in range(4):
            whole = next(one, None)
            halves = [next(p, None) for p in parts]
            if whole is None:
                assert halves == [None, None]
                break
            got = [h for h in halves if h is not None]
            np.testing.assert_array_equal(np.concatenate([h[0] for h in got]), whole[0])
            np.testing.assert_array_equal(np.concatenate([h[1] for h in got]), whole[1])
    got = list(
        shard_batches(lambda b: [np.arange(b)], {"batch_size": 2}, estimator.InputContext(2, 1, 2))
    )
    assert [x.tolist() for x in got] == [[2, 3]]


def test_single_process_helpers_are_pass_through():
    assert multihost.any_of(True, False) == (True, False)
    assert multihost.gather_objects({"a": 1}) == [{"a": 1}]
    assert multihost.run_on_process_0(lambda: 5, "x") == 5
    x = np.arange(12).reshape(2, 6)
    assert multihost.local_rows(x, None) is x


# ----------------------------------------------------------------------------- end to end
def _events(logdir: str, tag: str) -> dict[int, list[float]]:
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(logdir, size_guidance={ea.SCALARS: 0}, purge_orphaned_data=False)
    acc.Reload()
    out: dict[int, list[float]] = {}
    for e in acc.Scalars(tag):
        out.setdefault(e.step, []).append(e.value)
    return out


def _event_file_pids(model_dir: str) -> set[int]:
    names = glob.glob(os.path.join(model_dir, "**", "events.out.tfevents.*"), recursive=True)
    return {int(os.path.basename(n).split(".")[-2]) for n in names}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job in this process: 8 devices, 8 replicas, the same global batches."""
    model_dir = str(tmp_path_factory.mktemp("reference"))
    est, fns = job.build(model_dir)
    est.train(fns["train"], max_steps=job.MAX_STEPS)
    return {
        "model_dir": model_dir,
        "params": read_variables(model_dir),
        "eval": est.evaluate(fns["eval"]),
        "predict": [int(p["class_ids"]) for p in est.predict(fns["predict"])],
    }


def _wait_for(predicate, procs, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            launch.kill_all(procs)
            pytest.fail(f"{what}: not reached (exit codes {[p.poll() for p in procs]})")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """Run 1 trains (slowly after step 9) until the step-9 checkpoint, then process 1 is
    SIGKILLed; run 2
    restarts both processes, which resume and finish the job (train to 18, eval, predict)."""
    root = tmp_path_factory.mktemp("two_processes")
    model_dir, out_dir = str(root / "model"), str(root / "out")
    os.makedirs(out_dir)
    first = launch.start_local(
        2,
        [
            model_dir,
            out_dir,
            "--max_steps",
            "60",
            "--sleep",
            "2",
            "--sleep_from",
            str(job.SAVE_EVERY),
            "--train_only",
        ],
        command=JOB,
        log_dir=str(root / "logs_killed"),
        timeouts=TIMEOUTS,
    )
    try:
        _wait_for(
            lambda: os.path.isdir(os.path.join(model_dir, "model.ckpt-9")),
            first,
            RUN_TIMEOUT,
            "the step-9 checkpoint of the first run",
        )
        # Killed in its 2 s sleep after a loop: mid-collective, gloo's own abort on CPU can
        # end the survivor first (docs/multihost.md, "When a process dies").
        _wait_for(
            lambda: "LOOP 12" in (root / "logs_killed" / "process_1.log").read_text(),
            first,
            RUN_TIMEOUT,
            "the loop after the step-9 checkpoint",
        )
        first[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            survivor_rc = first[0].wait(timeout=60)
        except subprocess.TimeoutExpired:
            survivor_rc = None
        survivor_secs = time.monotonic() - killed_at
    finally:
        launch.kill_all(first)
    with open(root / "logs_killed" / "process_0.log") as f:
        survivor_log = f.read()
    second = launch.start_local(
        2, [model_dir, out_dir], command=JOB, log_dir=str(root / "logs"), timeouts=TIMEOUTS
    )
    rc = launch.wait_all(second, timeout=RUN_TIMEOUT, grace=20)
    logs = [(root / "logs" / f"process_{i}.log").read_text() for i in (0, 1)]
    assert rc == 0, "restarted run failed:\n" + "\n".join(log[-3000:] for log in logs)
    results = [json.loads((root / "out" / f"process_{i}.json").read_text()) for i in (0, 1)]
    return {
        "model_dir": model_dir,
        "survivor_rc": survivor_rc,
        "survivor_secs": survivor_secs,
        "survivor_log": survivor_log,
        "killed_pid": first[1].pid,
        "results": results,
        "logs": logs,
    }


def test_killed_process_makes_the_other_exit_in_order_within_the_timeout(two_process_runs):
    """SIGKILL of process 1: process 0 exits with the documented code within the bound, after
    ONE message naming the lost process and the last committed checkpoint; no abort from
    C++ (before the watchdog: exit -6 after JAX's heartbeat timeout, with a stack trace)."""
    run = two_process_runs
    assert run["survivor_rc"] == watchdog.HOST_LOST_EXIT_CODE, run["survivor_log"][-3000:]
    assert run["survivor_secs"] < TIMEOUTS["heartbeat_timeout"] + 30
    lines = [ln for ln in run["survivor_log"].splitlines() if "Lost process" in ln]
    assert len(lines) == 1, run["survivor_log"][-3000:]
    assert f"Lost process 1 (host {socket.gethostname()}, pid {run['killed_pid']})" in lines[0]
    assert "Last committed checkpoint: " in lines[0] and "model.ckpt-" in lines[0]
    named = int(lines[0].split("model.ckpt-")[1].split(".")[0])
    assert named >= job.SAVE_EVERY and named % job.SAVE_EVERY == 0
    assert f"exits with code {watchdog.HOST_LOST_EXIT_CODE}" in lines[0]
    assert "detected fatal errors" not in run["survivor_log"]
    assert "Check failure" not in run["survivor_log"]


def test_restarting_both_processes_resumes_from_the_checkpoint(two_process_runs):
    for result, log in zip(two_process_runs["results"], two_process_runs["logs"], strict=True):
        assert (result["start_step"], result["final_step"]) == (9, job.MAX_STEPS)
        assert "Restored checkpoint" in log and "model.ckpt-9" in log
        assert (result["process_count"], result["local_devices"], result["replicas"]) == (2, 4, 8)


def test_two_processes_match_one_process(two_process_runs, reference):
    """Params (after the kill and resume), eval results and predictions equal one 8-device
    process; both processes return identical eval results."""
    params = read_variables(two_process_runs["model_dir"])
    assert sorted(params) == sorted(reference["params"])
    for name, want in reference["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    p0, p1 = two_process_runs["results"]
    assert p0["eval"] == p1["eval"]
    assert p0["eval"]["global_step"] == job.MAX_STEPS == reference["eval"]["global_step"]
    assert p0["eval"]["accuracy"] == pytest.approx(reference["eval"]["accuracy"], abs=1e-12)
    assert p0["eval"]["loss"] == pytest.approx(reference["eval"]["loss"], rel=1e-5)
    # gather_to_process_0: process 0 yields every example in input order, process 1 none.
    assert p0["predict_gathered"] == reference["predict"] and p1["predict_gathered"] == []
    # By default each process yields its own rows: the first half of every global batch is
    # process 0's (the last, short batch of 23 rows is all process 0's).
    merged, i0, i1, half = [], 0, 0, job.EVAL_BATCH // 2
    for start in range(0, len(reference["predict"]), job.EVAL_BATCH):
        n = min(job.EVAL_BATCH, len(reference["predict"]) - start)
        a, b = min(half, n), n - min(half, n)
        merged += p0["predict_local"][i0 : i0 + a] + p1["predict_local"][i1 : i1 + b]
        i0, i1 = i0 + a, i1 + b
    assert (i0, i1) == (len(p0["predict_local"]), len(p1["predict_local"]))
    assert merged == reference["predict"]


def test_summaries_come_from_process_0_with_global_host_tensors(two_process_runs, reference):
    """Only process 0 wrote events; its host_call saw all 8 replicas' losses (the summary
    equals the one-process run's, which averages the same 8 values)."""
    run = two_process_runs
    pids = _event_file_pids(run["model_dir"])
    assert run["results"][0]["pid"] in pids
    assert not pids & {run["results"][1]["pid"], run["killed_pid"]}
    got = _events(run["model_dir"], "train/loss")
    want = _events(reference["model_dir"], "train/loss")
    # The model's host_call writes at the step before each update (0-17).
    assert sorted(want) == list(range(job.MAX_STEPS))
    # The killed run's process 0 aborted before flushing all of its events; the restarted
    # run wrote steps 9-17 (and closed its writer).
    assert set(range(job.SAVE_EVERY, job.MAX_STEPS)) <= set(got) <= set(want)
    for step, values in got.items():
        np.testing.assert_allclose(values, want[step][0], rtol=1e-5, err_msg=f"step {step}")
    eval_pids = _event_file_pids(os.path.join(run["model_dir"], "eval"))
    assert eval_pids == {run["results"][0]["pid"]}


def test_two_processes_with_split_params_match_one_replicated_process(tmp_path, reference):
    """TPUConfig(shard_params=True) across two processes: each process holds its devices'
    slices of the parameters and Adam state; checkpoints, evaluation (params gathered) and
    predictions equal the one-process replicated run."""
    model_dir, out_dir = str(tmp_path / "model"), str(tmp_path / "out")
    os.makedirs(out_dir)
    procs = launch.start_local(
        2,
        [model_dir, out_dir, "--shard_params"],
        command=JOB,
        log_dir=str(tmp_path / "logs"),
        timeouts=TIMEOUTS,
    )
    rc = launch.wait_all(procs, timeout=RUN_TIMEOUT, grace=20)
    logs = [(tmp_path / "logs" / f"process_{i}.log").read_text() for i in (0, 1)]
    assert rc == 0, "\n".join(log[-3000:] for log in logs)
    params = read_variables(model_dir)
    assert sorted(params) == sorted(reference["params"])
    for name, want in reference["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    p0, p1 = (json.loads((tmp_path / "out" / f"process_{i}.json").read_text()) for i in (0, 1))
    whole = sum(v.nbytes for k, v in reference["params"].items() if k != "global_step")
    for p in (p0, p1):  # the 64x64 kernel (of 4,810 parameters) and its Adam slots are split
        held_params, held_opt = p["bytes_per_device"]
        assert held_params < 0.3 * whole and held_opt < 0.6 * whole
    assert p0["eval"] == p1["eval"]
    assert p0["eval"]["loss"] == pytest.approx(reference["eval"]["loss"], rel=1e-5)
    assert p0["predict_gathered"] == reference["predict"]
