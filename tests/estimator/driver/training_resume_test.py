"""Exact resume: a training job SIGKILLed at random points, restarted with the same command,
ends bitwise equal to a run that was never interrupted.

The job (``tests/estimator/_train_job.py``) trains on 8 simulated devices with BatchNorm
state, dropout RNG and Adam state, checkpointing every 4 steps. It is killed after a random
device loop, while a checkpoint is being written (a ``*.orbax-checkpoint-tmp`` directory is
left behind), and after a random delay (anywhere: start-up, restore, compile, training).
The random points come from a seed printed on failure (set ``FAULT_SEED`` to replay one).
"""

from __future__ import annotations

import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

ROOT = Path(__file__).resolve().parents[3]
MAX_STEPS = 40


class Job:
    """The training job as a subprocess whose stdout lines can be waited on."""

    def __init__(self, model_dir: Path, log: Path, *extra: str):
        cmd = [
            sys.executable,
            "-m",
            "tests.estimator._train_job",
            str(model_dir),
            "--max_steps",
            str(MAX_STEPS),
            *extra,
        ]
        self.err = open(log, "a")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.err, text=True, bufsize=1
        )
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next_line(self, deadline: float) -> str | None:
        """The next stdout line; None at the end of the output. Fails at the deadline."""
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                pytest.fail(f"job timed out; output so far: {self.seen[-20:]}")
            if line is not None:
                self.seen.append(line)
            return line

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.wait()

    def wait(self) -> int:
        code = self.proc.wait(timeout=120)
        self.err.close()
        return code


def _steps(model_dir: Path) -> set[str]:
    """The finished checkpoint steps, as strings (``model.ckpt-<step>`` directories)."""
    if not model_dir.is_dir():
        return set()
    return {m[1] for p in model_dir.iterdir() if (m := re.fullmatch(r"model\.ckpt-(\d+)", p.name))}


def _tmp_dirs(model_dir: Path) -> list[str]:
    if not model_dir.is_dir():
        return []
    return [p.name for p in model_dir.iterdir() if "orbax-checkpoint-tmp" in p.name]


def _loop_step(line: str) -> int | None:
    return int(line.split()[1]) if line.startswith("LOOP ") else None


def _saving_step(line: str) -> int | None:
    if line.startswith("Saving checkpoints for "):
        return int(line.split()[3])
    return None


def _run_until(job: Job, should_kill, *, timeout: float = 90) -> tuple[bool, str | None]:
    """Reads the job's output; SIGKILLs it when ``should_kill(line)``. Returns (killed, line)."""
    deadline = time.monotonic() + timeout
    while True:
        line = job.next_line(deadline)
        if line is None:
            assert job.wait() == 0, f"job failed; output: {job.seen[-20:]}"
            return False, None
        if should_kill(line):
            job.kill()
            return True, line


def _run_for(job: Job, seconds: float) -> bool:
    """Lets the job run for ``seconds`` and SIGKILLs it; returns whether it was still running."""
    try:
        job.proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        job.kill()
        return True
    assert job.wait() == 0, f"job failed; output: {job.seen[-20:]}"
    return False


def _read_step(model_dir: Path, step: int) -> dict:
    """Every array of a checkpoint, read back with Orbax directly (not through the estimator)."""
    path = model_dir / f"model.ckpt-{step}"
    ckptr = ocp.PyTreeCheckpointer()
    out = {}
    for item in ("variables", "train"):
        leaves = jax.tree_util.tree_flatten_with_path(ckptr.restore(path / item))[0]
        out.update({f"{item}{jax.tree_util.keystr(k)}": np.asarray(v) for k, v in leaves})
    out["meta"] = (path / "meta" / "metadata").read_text()
    return out


def _assert_bitwise_equal(a: dict, b: dict, context: str) -> None:
    assert sorted(a) == sorted(b), context
    for name in a:
        if name == "meta":
            assert a[name] == b[name], f"{context}: meta {a[name]} != {b[name]}"
        else:
            assert a[name].dtype == b[name].dtype, f"{context}: {name}"
            assert np.array_equal(a[name], b[name]), f"{context}: {name} differs"


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_sigkill_at_random_points_resumes_bitwise(tmp_path):
    seed = int(os.environ.get("FAULT_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    context = f"FAULT_SEED={seed}"
    cache = str(tmp_path / "cache")
    log = tmp_path / "jobs.log"
    reference = Job(tmp_path / "reference", log, "--cache", cache)

    model_dir = tmp_path / "killed"
    job_args = ("--sleep", "0.03", "--cache", cache)
    loop_a, loop_b = sorted(rng.sample(range(6, MAX_STEPS - 4, 2), 2))
    plan = [
        ("loop", loop_a),
        ("saving", loop_a + 2),
        ("time", rng.uniform(0.5, 4.0)),
        ("loop", loop_b),
    ]
    events, saved_before, retries = [], set(), 3
    while plan:
        kind, point = plan.pop(0)
        job = Job(model_dir, log, *job_args)
        if kind == "time":
            killed, line = _run_for(job, point), None
        elif kind == "loop":
            killed, line = _run_until(job, lambda s, k=point: (_loop_step(s) or 0) >= k)
        else:  # during a checkpoint write: kill on the log line, the write is still running
            killed, line = _run_until(job, lambda s, k=point: (_saving_step(s) or 0) >= k)
        mid_write = None
        if kind == "saving" and killed:
            step = _saving_step(line)
            mid_write = str(step) not in _steps(model_dir) and any(
                t.startswith(f"model.ckpt-{step}.orbax-checkpoint-tmp")
                for t in _tmp_dirs(model_dir)
            )
            if not mid_write and retries:  # the write won the race: try at the next save
                retries -= 1
                plan.insert(0, (kind, step + 2))
        events.append((kind, point, killed, line, mid_write))
        now = _steps(model_dir)
        assert saved_before <= now, f"{context}: checkpoints deleted: {saved_before - now}"
        saved_before = now
        if not killed:
            break
    assert any(e[4] for e in events), (
        f"{context}: no kill landed during a checkpoint write: {events}"
    )

    final = Job(model_dir, log, *job_args)
    killed, _ = _run_until(final, lambda s: False)
    assert not killed and final.seen[-1] == f"DONE {MAX_STEPS}", final.seen[-5:]
    assert not _tmp_dirs(model_dir), "a restarted trainer cleans up unfinished writes"
    assert saved_before <= _steps(model_dir), f"{context}: checkpoints were deleted"
    assert reference.wait() == 0

    got = _read_step(model_dir, MAX_STEPS)
    want = _read_step(tmp_path / "reference", MAX_STEPS)
    _assert_bitwise_equal(got, want, f"{context}, kills: {events}")
    assert any(name.startswith("train['opt_state']") for name in got)  # Adam state compared
    assert any("batch_stats" in name for name in got)  # mutable collections compared
