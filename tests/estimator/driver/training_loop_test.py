"""Reliability of the training loop (issue 18, items 1-4 and 8), each in the form it was found.

- a short batch inside an endless stream is skipped, not taken for the end of the input;
- a NaN reached by the params or optimizer state with a finite loss is never checkpointed;
- SIGTERM wherever it lands (a stalled input, a slow host_call, the end-of-call checkpoint
  write) gives a committed checkpoint and ``Preempted`` within a bound; the host-call queue
  is bounded;
- Ctrl-C: the first SIGINT saves and raises one line, a second aborts at once;
- int64 values beyond int32 are an error naming the entry, unless 64-bit mode is on.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
import hooks
from estimator.driver import host as host_lib
from estimator.io import checkpoint as ckpt_lib
from tests import helpers as h

ROOT = Path(__file__).resolve().parents[3]


def _saved_steps(model_dir) -> list[int]:
    return sorted(int(p.name.split("-")[-1]) for p in Path(model_dir).glob("model.ckpt-*[0-9]"))


# ----------------------------------------------------------------------------- 1: short batches
def _epochs(x, y, b: int, *, epochs: int | None = None, short: bool = True):
    """The README's stream: shuffled epochs, each ending with a short batch (or without it)."""

    def input_fn(params):
        rng, e = np.random.default_rng(0), 0
        while epochs is None or e < epochs:
            order = rng.permutation(len(x))
            for i in range(0, len(x), b):
                if short or i + b <= len(x):
                    yield {"x": x[order[i : i + b]]}, y[order[i : i + b]]
            e += 1

    return input_fn


def test_short_batch_inside_the_stream_is_skipped_and_training_continues(tmp_path, caplog):
    x, y = h.make_data(n=36)  # batch 16: each epoch is 2 full batches and one of 4 rows
    with caplog.at_level(logging.WARNING, logger="estimator"):
        est = h.make_estimator(
            tmp_path / "short", ipl=5, save_checkpoints_steps=1000, keep_checkpoint_max=None
        )
        est.train(_epochs(x, y, 16), max_steps=18)  # 8 short batches before step 18
    assert est.get_variable_value("global_step") == 18
    skipped = [r.getMessage() for r in caplog.records if "short training batch" in r.getMessage()]
    # The first names the step and the rows; the rest are counted once, at the end of train.
    assert skipped[0] == (
        "Skipping a short training batch of 4 rows (batch size 16) before global step 3; "
        "short batches inside the input (e.g. each epoch's last) are skipped, not trained on, "
        "and counted once at the end."
    ), skipped
    assert len(skipped) == 2, skipped
    # 8 before step 18; the input thread may have read (and skipped) one more ahead.
    more = int(skipped[1].split()[1])
    assert (
        skipped[1]
        == f"Skipped {more} more short training batches ({more + 1} in all; not trained on)."
    )
    assert 7 <= more <= 8
    meta = ckpt_lib.Checkpoints(str(tmp_path / "short"), read_only=True).meta(18)
    assert (meta["input_pulls"], meta["skipped_pulls"]) == (26, 8)
    # A new estimator resumes past the skipped batches (the fast-forward counts them) ...
    h.make_estimator(
        tmp_path / "short", ipl=5, save_checkpoints_steps=1000, keep_checkpoint_max=None
    ).train(_epochs(x, y, 16), max_steps=24)
    resumed = h.make_estimator(
        tmp_path / "short", ipl=5, save_checkpoints_steps=1000, keep_checkpoint_max=None
    )
    # ... and matches an independent reference: the stream without its short batches.
    ref = h.make_estimator(
        tmp_path / "ref", ipl=5, save_checkpoints_steps=1000, keep_checkpoint_max=None
    )
    ref.train(_epochs(x, y, 16, short=False), max_steps=24)
    h.assert_params_close(h.params_of(resumed), h.params_of(ref), rtol=0, atol=0)


def test_short_batches_in_per_host_v2_leave_every_replica_a_full_batch(tmp_path, caplog):
    """An epoch shorter than a step (8 pulls of 8 rows each): the short pull is replaced."""
    x, y = h.make_data(n=36)  # per-replica batch 8: 4 full batches and one of 4 rows
    per_host_v2 = {"per_host_input_for_training": estimator.InputPipelineConfig.PER_HOST_V2}
    runs = {}
    for name, short in (("short", True), ("ref", False)):
        est = estimator.TPUEstimator(
            h.model_fn,
            config=h.config(tmp_path / name, iterations_per_loop=3, tpu=per_host_v2),
            train_batch_size=64,
        )
        with caplog.at_level(logging.WARNING, logger="estimator"):
            est.train(_epochs(x, y, 8, short=short), max_steps=6)
        runs[name] = h.params_of(est)
    assert runs["short"]["global_step"] == 6
    assert "Skipping a short training batch of 4 rows (batch size 8)" in caplog.text
    h.assert_params_close(runs["short"], runs["ref"], rtol=0, atol=0)


def test_input_that_ends_says_at_which_step_and_that_max_steps_was_not_reached(tmp_path, caplog):
    x, y = h.make_data(n=100)
    with caplog.at_level(logging.WARNING, logger="estimator"):
        est = h.make_estimator(
            tmp_path, ipl=5, save_checkpoints_steps=1000, keep_checkpoint_max=None
        )
        est.train(_epochs(x, y, 16, epochs=3), max_steps=100)
    assert est.get_variable_value("global_step") == 18  # 3 epochs of 6 full batches
    assert "Input ended at global step 18: max_steps = 100 was not reached." in caplog.messages, (
        caplog.messages
    )


# ----------------------------------------------------------------------------- 2: non-finite state
def _poison_at(step: int, *, where: str):
    """An optimizer stage that makes the updates (``where="params"``) or only its own state
    (``"opt_state"``) NaN at ``step``; the loss of that step is finite."""

    def init(params):
        return {"count": jnp.zeros([], jnp.int32), "acc": jnp.zeros([], jnp.float32)}

    def update(updates, state, params=None):
        count = state["count"] + 1
        nan = jnp.where(count == step, jnp.nan, 0.0).astype(jnp.float32)
        if where == "params":
            updates = jax.tree.map(lambda u: u + nan, updates)
        return updates, {"count": count, "acc": state["acc"] + nan}

    return optax.GradientTransformation(init, update)


def _poisoned_model_fn(features, labels, mode, params):
    spec = h.model_fn(features, labels, mode, params)
    tx = optax.chain(optax.sgd(0.1), _poison_at(params["bad_step"], where=params["where"]))
    if mode == estimator.ModeKeys.TRAIN:
        spec.train_op = tx
    return spec


@pytest.mark.parametrize("where, named", [("params", "hidden/kernel"), ("opt_state", "opt_state/")])
def test_nonfinite_state_with_a_finite_loss_is_never_checkpointed(tmp_path, where, named):
    x, y = h.make_data()
    est = h.make_estimator(
        tmp_path,
        ipl=4,
        save_checkpoints_steps=4,
        model_fn=_poisoned_model_fn,
        params={"bad_step": 6, "where": where},
        keep_checkpoint_max=None,
    )
    # Step 6 is inside the second loop; with max_steps=6 it is also the last step of the call.
    with pytest.raises(hooks.NanLossDuringTrainingError, match="global step 6") as info:
        est.train(h.train_input_fn(x, y), max_steps=6)
    assert info.value.global_step == 6
    message = str(info.value)
    assert named in message and "loss" not in message.split("non-finite:")[1].split(";")[0]
    assert _saved_steps(tmp_path) == [4]  # nothing of step 5 or 6 was saved
    ckpts = ckpt_lib.Checkpoints(str(tmp_path), read_only=True)
    restored = ckpts.restore(4)
    for leaf in jax.tree.leaves(restored):
        assert np.isfinite(np.asarray(leaf)).all()
    # A restart resumes from the finite checkpoint and meets the same error at the same step.
    with pytest.raises(hooks.NanLossDuringTrainingError, match="global step 6"):
        est.train(h.train_input_fn(x, y), max_steps=6)


def test_finite_flags_find_every_nan_and_inf():
    """The device check (a sum per leaf) against numpy's isfinite, at every position class,
    in float32, bfloat16 and float16 leaves, small and large."""
    from estimator.engine.loops import finite_flags

    check = jax.jit(finite_flags)
    rng = np.random.default_rng(0)
    for dtype in (np.float32, jnp.bfloat16, np.float16):
        for n in (7, 100_003):
            for pos in (0, n // 2, n - 1):
                for bad in (np.nan, np.inf, -np.inf):
                    x = rng.standard_normal(n).astype(dtype)
                    x[pos] = bad
                    tree = {"ok": np.ones(3, dtype), "bad": x, "ints": np.arange(3)}
                    got = np.asarray(check(tree)).tolist()  # leaves in key order: bad, ok
                    assert got == [False, True], (dtype, n, pos, bad)


# ----------------------------------------------------------------------------- 8: int64
def test_int64_beyond_int32_is_an_error_naming_the_entry(tmp_path):
    x, y = h.make_data()
    big = y.astype(np.int64) + 2**32  # wraps to y in int32: trained identically before
    est = h.make_estimator(tmp_path, save_checkpoints_steps=1000, keep_checkpoint_max=None)
    with pytest.raises(ValueError, match=r"input batch entry \[1\] .*int64.*4294967296"):
        est.train(h.train_input_fn(x, big), max_steps=4)
    ids = {"x": x, "id": np.arange(len(x), dtype=np.int64) - 2**40}
    with pytest.raises(ValueError, match=r"entry \[0\]\['id'\]"):
        est.train(lambda params: iter([(ids, y)] * 2), max_steps=1)
    # int64 values inside int32's range are still accepted (numpy's default integer).
    est.train(h.train_input_fn(x, y.astype(np.int64)), max_steps=4)
    assert est.get_variable_value("global_step") == 4


def test_int64_is_kept_in_64_bit_mode(tmp_path):
    x, y = h.make_data()
    offset = 2**33

    def model_fn(features, labels, mode, params):
        assert labels.dtype == jnp.int64, labels.dtype  # kept, not narrowed to int32
        return h.model_fn(features, (labels - offset).astype(jnp.int32), mode, params)

    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        est = h.make_estimator(
            tmp_path / "x64",
            model_fn=model_fn,
            save_checkpoints_steps=1000,
            keep_checkpoint_max=None,
        )
        est.train(h.train_input_fn(x, y.astype(np.int64) + offset), max_steps=4)
        got = h.params_of(est)
    finally:
        jax.config.update("jax_enable_x64", previous)
    ref = h.make_estimator(tmp_path / "ref", save_checkpoints_steps=1000, keep_checkpoint_max=None)
    ref.train(h.train_input_fn(x, y), max_steps=4)
    h.assert_params_close(got, h.params_of(ref), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- 3: SIGTERM, save
class _SignalInWait:
    """Sends this process SIGTERM from inside the end-of-call checkpoint wait."""

    def __init__(self, monkeypatch):
        self.sent = 0
        original = ckpt_lib.Checkpoints.wait

        def wait(ckpts):
            if not self.sent:
                self.sent += 1
                os.kill(os.getpid(), signal.SIGTERM)
            return original(ckpts)

        monkeypatch.setattr(ckpt_lib.Checkpoints, "wait", wait)


def test_sigterm_during_the_final_checkpoint_write_still_raises_preempted(tmp_path, monkeypatch):
    x, y = h.make_data()
    est = h.make_estimator(tmp_path, ipl=2, save_checkpoints_steps=1000, keep_checkpoint_max=None)
    signals = _SignalInWait(monkeypatch)
    with pytest.raises(estimator.Preempted) as info:
        est.train(h.train_input_fn(x, y), max_steps=6)
    assert signals.sent == 1 and info.value.global_step == 6
    assert _saved_steps(tmp_path) == [6]

    # train_and_evaluate (hence the CLI) stops too: no more training, no final evaluation.
    signals.sent = 0
    train_spec = estimator.TrainSpec(h.train_input_fn(x, y), max_steps=12)
    eval_spec = estimator.EvalSpec(h.eval_input_fn(x, y), steps=1, throttle_secs=0)
    every_2 = h.make_estimator(tmp_path, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None)
    with pytest.raises(estimator.Preempted) as info:
        estimator.train_and_evaluate(every_2, train_spec, eval_spec)
    assert signals.sent == 1 and info.value.global_step == 8
    assert _saved_steps(tmp_path) == [6, 8]


# ----------------------------------------------------------------------------- 3, 4: real signals
class _Job:
    """A ``_signal_job`` subprocess whose stdout lines are read on a thread, with times."""

    def __init__(self, workdir: Path, cache: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.estimator._signal_job", str(workdir), "--cache", cache],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self._queue.put((time.monotonic(), line.rstrip("\n")))
        self._queue.put((time.monotonic(), None))

    def wait_for(self, prefix: str, timeout: float = 60) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                t, line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                message = f"no {prefix!r} in {timeout} s; last: {self.lines[-8:]}"
                raise AssertionError(message) from None
            if line is None:
                raise AssertionError(f"job ended before {prefix!r}; last: {self.lines[-8:]}")
            self.lines.append((t, line))
            if line.startswith(prefix):
                return t, line

    def signal(self, sig) -> float:
        self.proc.send_signal(sig)
        return time.monotonic()


PREEMPTION_BOUND_S = 10.0  # generous for a loaded CI machine; measured values in the docs


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("compilation_cache"))


def test_signals_stop_training_within_a_bound(tmp_path, cache):
    job = _Job(tmp_path, cache)
    try:
        _stalled_input(job, tmp_path)
        _slow_host_call(job, tmp_path)
        _double_ctrl_c(job, tmp_path)
        _ctrl_c(job, tmp_path)
    finally:
        job.proc.kill()


def _stalled_input(job, tmp_path):
    """SIGTERM while the trainer waits for an input that never yields again."""
    job.wait_for("PHASE stall")
    job.wait_for("STALLED")
    job.wait_for("LOOP 6")
    time.sleep(0.5)  # the trainer now waits for the next batch
    sent = job.signal(signal.SIGTERM)
    t, line = job.wait_for("PREEMPTED stall")
    print(f"stalled input: SIGTERM -> Preempted in {t - sent:.2f} s")
    assert line == "PREEMPTED stall 6" and t - sent < PREEMPTION_BOUND_S, (t - sent, line)
    assert _saved_steps(tmp_path / "stall") == [6]


def _slow_host_call(job, tmp_path):
    """A host_call slower than the device: the device waits; SIGTERM does not wait for it."""
    start = len(job.lines)
    job.wait_for("PHASE slow_host")
    job.wait_for("LOOP 30")
    sent = job.signal(signal.SIGTERM)
    t, line = job.wait_for("PREEMPTED slow_host")
    step = int(line.split()[2])
    print(f"slow host_call: SIGTERM -> Preempted in {t - sent:.2f} s")
    assert t - sent < PREEMPTION_BOUND_S and _saved_steps(tmp_path / "slow_host") == [step]
    hosted, lag = 0, 0
    for _, text in job.lines[start:]:  # how far the device ran ahead of the host calls
        if text.startswith("HOST "):
            hosted = int(text.split()[1])
        elif text.startswith("LOOP "):
            lag = max(lag, int(text.split()[1]) - hosted)
    print(f"slow host_call: the device ran at most {lag} steps ahead of the host")
    assert lag <= (host_lib.HOST_CALL_QUEUE_LOOPS + 1) * 2 + 1, lag  # 2 steps a loop


def _double_ctrl_c(job, tmp_path):
    """Two Ctrl-C: the second aborts at once (the hook still sleeps 3 s), without saving."""
    job.wait_for("PHASE abort")
    job.wait_for("LOOP 6")
    job.signal(signal.SIGINT)
    time.sleep(0.3)
    sent = job.signal(signal.SIGINT)
    t, line = job.wait_for("ABORTED")
    print(f"second Ctrl-C -> KeyboardInterrupt in {t - sent:.2f} s")
    assert t - sent < 2.0, t - sent
    assert "aborted" in line and _saved_steps(tmp_path / "abort") == []


def _ctrl_c(job, tmp_path):
    """One Ctrl-C: finishes the loop, saves, one line; the script ends with KeyboardInterrupt."""
    job.wait_for("PHASE interrupt")
    job.wait_for("LOOP 6")
    job.signal(signal.SIGINT)
    job.proc.wait(timeout=60)
    stderr = job.proc.stderr.read()
    print(stderr)
    last = stderr.strip().splitlines()[-1]
    prefix = "KeyboardInterrupt: interrupted at step "
    assert last.startswith(prefix) and last.endswith(", checkpoint saved; run again to resume")
    step = int(last[len(prefix) :].split(",")[0])
    assert _saved_steps(tmp_path / "interrupt") == [step] and step >= 6
    assert "cannot schedule new futures" not in stderr
    assert stderr.count("Traceback") == 1, stderr  # only the KeyboardInterrupt's own


def test_ctrl_c_in_the_cli_is_one_line_and_status_130(tmp_path, monkeypatch, capsys):
    from estimator.cli import app

    def interrupted(inv, out=None):
        raise KeyboardInterrupt("interrupted at step 6, checkpoint saved; run again to resume")

    monkeypatch.setattr(app, "run", interrupted)
    assert app.main(["train", "--model_dir", str(tmp_path)], out=sys.stdout) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "tpu-estimator: interrupted at step 6, checkpoint saved; run again to resume"
    ), err
    assert not any("Traceback" in line for line in err)
