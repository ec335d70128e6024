"""Preemption (SIGTERM), non-finite losses, input position via get_state/set_state, and
evaluation in another process while training writes checkpoints."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import estimator
import hooks
from estimator.data.inputs import decode_state, encode_state
from estimator.driver.preemption import EXIT_STATUS, Preempted
from tests import helpers as h

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """A compilation cache the training subprocesses share (they compile the same loops)."""
    return str(tmp_path_factory.mktemp("compilation_cache"))


def _saved_steps(model_dir) -> list[int]:
    return sorted(int(p.name.split("-")[-1]) for p in Path(model_dir).glob("model.ckpt-*[0-9]"))


# ----------------------------------------------------------------------------- SIGTERM
class _SigtermAt(hooks.SessionRunHook):
    """Sends this process SIGTERM after the loop that ends at ``step``; records the lifecycle."""

    def __init__(self, step: int):
        self.step, self.loops, self.ended = step, [], False

    def before_run(self, run_context):
        return hooks.SessionRunArgs("global_step")

    def after_run(self, run_context, run_values):
        self.loops.append(int(run_values.results[-1]))
        if self.loops[-1] == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def end(self, session):
        self.ended = True


def test_sigterm_checkpoints_at_the_loop_boundary_and_exits(tmp_path):
    x, y = h.make_data()
    previous = signal.getsignal(signal.SIGTERM)
    hook = _SigtermAt(6)
    est = h.make_estimator(
        tmp_path / "run", save_checkpoints_steps=100, ipl=2, keep_checkpoint_max=None
    )
    with pytest.raises(Preempted) as info:
        est.train(h.train_input_fn(x, y), max_steps=10, hooks=[hook])
    assert isinstance(info.value, SystemExit) and info.value.code == EXIT_STATUS == 143
    assert info.value.global_step == 6 and info.value.checkpoint.endswith("model.ckpt-6")
    assert hook.loops == [2, 4, 6] and hook.ended  # stopped at the next boundary, hooks ended
    assert _saved_steps(tmp_path / "run") == [6]  # saved although the cadence was not due
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler is removed again

    # The same command again resumes and ends exactly where an uninterrupted run does.
    resumed = h.make_estimator(
        tmp_path / "run", save_checkpoints_steps=100, ipl=2, keep_checkpoint_max=None
    )
    resumed.train(h.train_input_fn(x, y), max_steps=10)
    straight = h.make_estimator(
        tmp_path / "straight", save_checkpoints_steps=100, ipl=2, keep_checkpoint_max=None
    )
    straight.train(h.train_input_fn(x, y), max_steps=10)
    h.assert_params_close(h.params_of(resumed), h.params_of(straight), rtol=0, atol=0)


def test_sigterm_to_a_training_process_saves_and_exits_143(tmp_path, cache):
    model_dir = tmp_path / "job"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.estimator._train_job",
            str(model_dir),
            "--max_steps",
            "400",
            "--save_steps",
            "1000",
            "--sleep",
            "0.05",
            "--cache",
            cache,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.startswith("LOOP 6"):
            proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143, lines[-10:]
    last_loop = max(int(s.split()[1]) for s in lines if s.startswith("LOOP "))
    assert 6 <= last_loop < 400
    assert f"Saving checkpoints for {last_loop} into {model_dir}/model.ckpt-{last_loop}." in lines
    assert _saved_steps(model_dir) == [last_loop]  # complete on disk before the exit
    assert not [p for p in model_dir.iterdir() if "tmp" in p.name]


# ----------------------------------------------------------------------------- NaN / Inf
def _data_with(bad_value: float, row: int):
    x, y = h.make_data()
    x = x.copy()
    x[row, 0] = bad_value
    return x, y


@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
def test_nonfinite_loss_stops_at_its_step_before_any_checkpoint_of_it(tmp_path, bad_value):
    x, y = _data_with(bad_value, row=16 * 5 + 3)  # batch 5 = global step 6 (loop 5-8)
    est = h.make_estimator(tmp_path, ipl=4, save_checkpoints_steps=2, keep_checkpoint_max=None)
    with pytest.raises(hooks.NanLossDuringTrainingError, match="global step 6") as info:
        est.train(h.train_input_fn(x, y), max_steps=12)
    assert info.value.global_step == 6
    assert _saved_steps(tmp_path) == [4]  # the diverged loop (steps 5-8) was never saved
    for name in est.get_variable_names():
        assert np.isfinite(est.get_variable_value(name)).all(), name


def _nan_loss_only_model_fn(features, labels, mode, params):
    """The loss is NaN where ``features["probe"]`` is, the gradient and state stay finite."""
    spec = h.model_fn({"x": features["x"]}, labels, mode, params)
    spec.loss = spec.loss + 0.0 * jax.lax.stop_gradient(features["probe"].sum())
    return spec


def test_user_nan_hook_replaces_the_default_check(tmp_path, caplog):
    x, y = h.make_data()
    probe = np.zeros((len(x), 1), np.float32)
    probe[16 * 5 + 3] = np.nan  # batch 5 = global step 6: its loss is NaN, its state finite

    def input_fn(params):
        while True:
            for i in range(0, len(x), 16):
                yield {"x": x[i : i + 16], "probe": probe[i : i + 16]}, y[i : i + 16]

    est = estimator.TPUEstimator(
        _nan_loss_only_model_fn,
        config=h.config(tmp_path, iterations_per_loop=4, save_checkpoints_steps=2),
        train_batch_size=16,
    )
    with caplog.at_level(logging.ERROR, logger="estimator"):
        est.train(
            input_fn, max_steps=12, hooks=[hooks.NanTensorHook("loss", fail_on_nan_loss=False)]
        )
    assert "Model diverged with loss = NaN at global step 6" in caplog.text
    assert est.get_variable_value("global_step") == 8  # stopped after that loop, no error
    assert _saved_steps(tmp_path) == [4, 8]  # the state stayed finite: step 8 was saved


def test_skip_nonfinite_steps_skips_on_every_replica_and_counts(tmp_path):
    x, y = h.make_data()
    batches = [({"x": x[i : i + 16]}, y[i : i + 16]) for i in range(0, 96, 16)]
    bad = ({"x": batches[2][0]["x"].copy()}, batches[2][1])
    bad[0]["x"][11, 0] = np.nan  # one row, held by replica 5 of 8: every replica must skip
    with_bad = batches[:2] + [bad] + batches[3:]
    est = h.make_estimator(
        tmp_path / "skip",
        ipl=1,
        skip_nonfinite_steps=True,
        save_summary_steps=1,
        save_checkpoints_steps=2,
        keep_checkpoint_max=None,
    )
    est.train(lambda params: iter(with_bad), max_steps=6)
    reference = h.make_estimator(
        tmp_path / "ref", ipl=1, save_checkpoints_steps=2, keep_checkpoint_max=None
    )
    reference.train(lambda params: iter(batches[:2] + batches[3:]), max_steps=5)
    got, want = h.params_of(est), h.params_of(reference)
    assert got.pop("global_step") == 6 and want.pop("global_step") == 5
    h.assert_params_close(got, want, rtol=0, atol=0)
    events = EventAccumulator(str(tmp_path / "skip")).Reload()
    counts = {e.step: e.value for e in events.Scalars("nonfinite_steps")}
    assert counts == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 1}


# ----------------------------------------------------------------------------- input state
class Loader:
    """A pure-Python loader with Grain-style get_state/set_state (no restart from zero)."""

    def __init__(self, x, y, batch_size: int, *, as_bytes: bool = False):
        self.x, self.y, self.b, self.as_bytes = x, y, batch_size, as_bytes
        self.position, self.served, self.restored = 0, [], []

    def __iter__(self):
        return self

    def __next__(self):
        n = len(self.x) // self.b
        i = (self.position % n) * self.b
        self.served.append(self.position)
        self.position += 1
        return {"x": self.x[i : i + self.b]}, self.y[i : i + self.b]

    def get_state(self):
        state = {"position": self.position, "epoch": np.int64(self.position // 6)}
        return json.dumps({"position": self.position}).encode() if self.as_bytes else state

    def set_state(self, state):
        self.restored.append(state)
        self.position = (json.loads(state) if self.as_bytes else state)["position"]


class _WaitForReadAhead(hooks.SessionRunHook):
    """After the loop ending at ``step`` (just before its checkpoint), waits until the
    prefetcher has pulled later batches, so the live loader position is past the step."""

    def __init__(self, loaders: list, step: int):
        self.loaders, self.step, self.position_at_save = loaders, step, None

    def before_run(self, run_context):
        return hooks.SessionRunArgs("global_step")

    def after_run(self, run_context, run_values):
        if int(run_values.results[-1]) != self.step:
            return
        deadline = time.monotonic() + 10
        while self.loaders[-1].position <= self.step and time.monotonic() < deadline:
            time.sleep(0.01)
        self.position_at_save = self.loaders[-1].position


def test_get_state_set_state_positions_the_input(tmp_path):
    """A Grain-like loader whose state is bytes: saved per checkpoint, restored by set_state."""
    x, y = h.make_data()
    as_bytes = True
    loaders = []

    def input_fn(params):
        loaders.append(Loader(x, y, params["batch_size"], as_bytes=as_bytes))
        return loaders[-1]

    first = h.make_estimator(
        tmp_path / "run", ipl=2, save_checkpoints_steps=4, keep_checkpoint_max=None
    )
    ahead = _WaitForReadAhead(loaders, step=4)
    first.train(input_fn, max_steps=8, hooks=[ahead])
    assert ahead.position_at_save > 4  # the loader had been read past step 4 when it was saved
    meta = json.loads((tmp_path / "run/model.ckpt-4/meta/metadata").read_text())
    saved = decode_state(meta["input_state"])
    assert (json.loads(saved) if as_bytes else saved)["position"] == 4  # consumed, not read

    resumed = h.make_estimator(
        tmp_path / "run", ipl=2, save_checkpoints_steps=4, keep_checkpoint_max=None
    )
    resumed.train(input_fn, max_steps=16)
    assert loaders[1].restored and loaders[1].served[0] == 8  # set_state, no fast-forward
    straight = h.make_estimator(
        tmp_path / "straight", ipl=2, save_checkpoints_steps=4, keep_checkpoint_max=None
    )
    straight.train(h.train_input_fn(x, y), max_steps=16)
    h.assert_params_close(h.params_of(resumed), h.params_of(straight), rtol=0, atol=0)


def test_encode_state_round_trips_and_names_what_json_cannot_hold():
    state = {"a": b"\x00\xffraw", "b": [1, np.float32(2.5)], "c": {"d": "e"}}
    assert decode_state(encode_state(state)) == {
        "a": b"\x00\xffraw",
        "b": [1, 2.5],
        "c": {"d": "e"},
    }
    with pytest.raises(TypeError, match="get_state.*object"):
        encode_state({"it": object()})


# ----------------------------------------------------------------------------- concurrency
def test_evaluation_in_another_process_reads_only_complete_checkpoints(tmp_path, caplog, cache):
    from tests.estimator import _train_job as job

    model_dir, last = tmp_path / "job", 20
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.estimator._train_job",
            str(model_dir),
            "--max_steps",
            str(last),
            "--save_steps",
            "2",
            "--sleep",
            "0.15",
            "--cache",
            cache,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    reader = job.make_estimator(str(model_dir), save_steps=2, keep=None, cache=None)
    seen, deadline = [], time.monotonic() + 90
    with caplog.at_level(logging.WARNING, logger="estimator"):
        while time.monotonic() < deadline:
            if not model_dir.is_dir() or reader.latest_checkpoint() is None:
                time.sleep(0.05)
                continue
            r = reader.evaluate(job._eval_input_fn)
            seen.append((int(r["global_step"]), r["loss"]))
            if seen[-1][0] == last or trainer.poll() is not None:
                break
    assert trainer.wait(timeout=60) == 0
    assert "unreadable" not in caplog.text and "Skipping" not in caplog.text
    steps = [s for s, _ in seen]
    assert len(set(steps)) >= 3 and steps == sorted(steps), steps
    # Each result is exactly what that checkpoint gives once training is over: it was complete.
    for step, loss in seen:
        again = reader.evaluate(
            job._eval_input_fn, checkpoint_path=str(model_dir / f"model.ckpt-{step}")
        )
        assert again["loss"] == loss, step
