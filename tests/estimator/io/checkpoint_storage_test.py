"""Reliability, round two (issue 18, the checkpoint and storage half).

Each test reproduces a failure in the form it was found: two trainers (two real processes) on
one model_dir; an evaluator polling a trainer that rotates its checkpoints; a model_dir whose
name holds glob characters; an optimizer changed between runs; a damaged final checkpoint
and the same ``train`` call run again; a one-byte edit and a crafted ``input_pulls`` in a
checkpoint's JSON meta; bfloat16 parameters on eight CPU devices.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
import hooks
from estimator.io import checkpoint as ckpt_lib
from estimator.io import lock as lock_lib
from estimator.io import model_dir as model_dir_lib
from tests import helpers as h
from tests.estimator import _train_job as job

ROOT = Path(__file__).resolve().parents[3]
# Orbax's asyncio helpers print "Event loop is closed" after a failed read; that is noise.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """A compilation cache the job subprocesses and this process share (same loops)."""
    return str(tmp_path_factory.mktemp("compilation_cache"))


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "adam": lambda: optax.adam(0.01),
    "adamw": lambda: optax.adamw(0.01),
}


def _model_fn(features, labels, mode, params):
    """The helpers' MLP with a choice of optimizer (``params['optimizer']``, default sgd)."""
    spec = h.model_fn(features, labels, mode, params)
    if mode == estimator.ModeKeys.TRAIN:
        spec.train_op = OPTIMIZERS[params.get("optimizer", "sgd")]()
    return spec


def _step_dir(model_dir, step: int) -> Path:
    """Where a step's checkpoint lives (whatever the layout names it)."""
    return Path(ckpt_lib.Checkpoints(str(model_dir), read_only=True).path(step))


def _on_disk(model_dir) -> list[str]:
    """Every name in the directory that holds the step directories."""
    return sorted(os.listdir(model_dir_lib.checkpoint_dir(str(model_dir))))


@contextmanager
def _deadline(seconds: int):
    """Fails the test instead of hanging (SIGALRM in the main thread)."""

    def fail(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Checkpoints 2, 4, 6 of an uninterrupted run, its step-4 evaluation, and the params of
    uninterrupted runs to steps 6 and 8 (the references)."""
    x, y = h.make_data()
    base = tmp_path_factory.mktemp("trained")
    run = h.make_estimator(
        base / "run", model_fn=_model_fn, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None
    )
    run.train(h.train_input_fn(x, y), max_steps=6)
    at4 = run.evaluate(h.eval_input_fn(x, y), checkpoint_path=str(_step_dir(base / "run", 4)))
    to8 = h.make_estimator(
        base / "to8", model_fn=_model_fn, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None
    )
    to8.train(h.train_input_fn(x, y), max_steps=8)
    return {"dir": base / "run", "at4": at4, "at6": h.params_of(run), "at8": h.params_of(to8)}


def _copy(trained, tmp_path) -> Path:
    shutil.copytree(trained["dir"], tmp_path / "run")
    return tmp_path / "run"


# ----------------------------------------------------------------------------- items 5, 6
@pytest.fixture(scope="module")
def rotating_job(tmp_path_factory, cache):
    """A trainer subprocess that saves every loop and keeps one checkpoint (it rotates one
    away each loop), and an estimator in this process on the same model_dir."""
    base = tmp_path_factory.mktemp("rotating")
    model_dir = base / "job"
    with open(base / "stdout.txt", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.estimator._train_job", str(model_dir)]
            + ["--max_steps", "100000", "--save_steps", "2", "--keep", "1", "--cache", cache],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.DEVNULL,
        )
    other = job.make_estimator(str(model_dir), save_steps=2, keep=None, cache=cache)
    try:
        deadline = time.monotonic() + 120
        while other.latest_checkpoint() is None:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        yield proc, model_dir, other
    finally:
        proc.kill()
        proc.wait(timeout=60)


def _warnings(caplog) -> list[str]:
    """The estimator's warnings (Orbax's own notes on read-only managers are not ours)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "estimator" and r.levelno >= logging.WARNING
    ]


def test_a_second_trainer_fails_at_once_naming_the_directory_and_the_holder(rotating_job):
    proc, model_dir, other = rotating_job
    held = json.loads((model_dir / lock_lib.LOCK_NAME).read_text())
    assert (held["host"], held["pid"]) == (socket.gethostname(), proc.pid)
    started = time.monotonic()
    with pytest.raises(estimator.ModelDirInUseError) as info:
        other.train(job.input_fn, max_steps=100)
    message = str(info.value)
    assert str(model_dir) in message and f"host {socket.gethostname()}, pid {proc.pid}" in message
    assert time.monotonic() - started < 2  # at once: before input_fn or any compile
    assert proc.poll() is None  # the running trainer is untouched


def test_an_evaluator_polling_a_rotating_trainer_never_fails_or_warns(rotating_job, caplog):
    proc, _, reader = rotating_job
    listed, evaluated = 0, []
    with caplog.at_level(logging.INFO, logger="estimator"):
        # Until the reader has seen three checkpoints come and go (a slow machine takes longer;
        # the deadline only bounds a trainer that stopped saving).
        deadline = time.monotonic() + 90
        while len(set(evaluated)) < 3 or listed < 20:
            assert time.monotonic() < deadline, evaluated
            for _ in range(10):
                assert reader.latest_checkpoint() is not None
                listed += 1
            evaluated.append(int(reader.evaluate(job._eval_input_fn, steps=1)["global_step"]))
    assert proc.poll() is None  # still training and rotating all along
    assert not _warnings(caplog)
    assert evaluated == sorted(evaluated) and len(set(evaluated)) >= 3, evaluated
    assert listed >= 20


def test_the_lock_of_a_killed_trainer_is_taken_over(rotating_job, caplog):
    proc, model_dir, _ = rotating_job
    proc.kill()  # SIGKILL: the lock file stays behind, naming a dead process
    proc.wait(timeout=60)
    assert json.loads((model_dir / lock_lib.LOCK_NAME).read_text())["pid"] == proc.pid
    lock = lock_lib.TrainerLock(str(model_dir))
    with caplog.at_level(logging.WARNING, logger="estimator"):
        lock.acquire()
    assert f"pid {proc.pid}" in caplog.text and "no longer running" in caplog.text
    assert json.loads((model_dir / lock_lib.LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert (model_dir / lock_lib.LOCK_NAME).read_text() == ""


def test_a_lock_from_another_host_holds_until_its_heartbeat_is_stale(tmp_path, caplog):
    path = tmp_path / lock_lib.LOCK_NAME
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(estimator.ModelDirInUseError, match="host elsewhere, pid 1"):
        lock_lib.TrainerLock(str(tmp_path)).acquire()
    stale = time.time() - lock_lib.STALE_SECS - 1
    os.utime(path, (stale, stale))  # no heartbeat for longer than STALE_SECS
    lock = lock_lib.TrainerLock(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="estimator"):
        lock.acquire()
    assert "host elsewhere, pid 1" in caplog.text
    lock.release()


def test_the_lock_is_held_for_the_train_call_and_released_on_error(tmp_path):
    x, y = h.make_data()
    est, other = (
        h.make_estimator(
            tmp_path, ipl=1, model_fn=_model_fn, save_checkpoints_steps=2, keep_checkpoint_max=None
        ),
        h.make_estimator(
            tmp_path, ipl=1, model_fn=_model_fn, save_checkpoints_steps=2, keep_checkpoint_max=None
        ),
    )
    seen = []

    class Probe(hooks.SessionRunHook):
        def after_run(self, run_context, run_values):
            with pytest.raises(estimator.ModelDirInUseError, match=f"pid {os.getpid()}"):
                other.train(h.train_input_fn(x, y), max_steps=2)  # same process, 2nd trainer
            seen.append(True)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        est.train(h.train_input_fn(x, y), max_steps=1, hooks=[Probe()])
    assert seen == [True]
    assert (tmp_path / lock_lib.LOCK_NAME).read_text() == ""  # the failed call released it
    lock = lock_lib.TrainerLock(str(tmp_path))
    lock.acquire()
    lock.release()


def test_a_save_that_did_not_happen_is_an_error(tmp_path):
    ckpts = ckpt_lib.Checkpoints(str(tmp_path), max_to_keep=None)
    variables, train = {"params": {"w": np.ones(3, np.float32)}}, {"step": np.int32(5)}
    ckpts.save(5, variables, train, {"global_step": 5, "input_pulls": 5})
    ckpts.wait()
    with pytest.raises(estimator.CheckpointError, match=r"step 3 .*newest is 5"):
        ckpts.save(3, variables, train, {"global_step": 3, "input_pulls": 3})
    ckpts.close()
    assert ckpt_lib.Checkpoints(str(tmp_path), read_only=True).steps() == [5]


def test_a_step_vanishing_between_listing_and_reading_is_skipped_quietly(
    trained, tmp_path, monkeypatch, caplog
):
    model_dir = _copy(trained, tmp_path)
    listing = ckpt_lib.Checkpoints.steps

    def listing_then_rotation(self):
        steps = listing(self)
        if 6 in steps:  # listed, then removed by a writer before it is read
            shutil.rmtree(self.path(6))
        return steps

    monkeypatch.setattr(ckpt_lib.Checkpoints, "steps", listing_then_rotation)
    x, y = h.make_data()
    with caplog.at_level(logging.INFO, logger="estimator"):
        got = h.make_estimator(
            model_dir, model_fn=_model_fn, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None
        ).evaluate(h.eval_input_fn(x, y))
    assert got["global_step"] == 4 and got["loss"] == trained["at4"]["loss"]
    assert not _warnings(caplog)


# ----------------------------------------------------------------------------- item 7: names
@pytest.mark.parametrize("name", ["run[1]", "a\\b", "run*", "run?"])
def test_a_model_dir_with_glob_characters_fails_at_construction(tmp_path, name):
    model_dir = str(tmp_path / name)
    with pytest.raises(ValueError, match=r"model_dir .* glob"):
        h.make_estimator(
            model_dir, model_fn=_model_fn, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None
        )
    with pytest.raises(ValueError, match="glob"):
        ckpt_lib.Checkpoints(model_dir)
    assert not os.path.exists(model_dir)  # nothing written that could not be read back


def test_a_model_dir_with_other_punctuation_trains_and_reads_back(tmp_path):
    x, y = h.make_data()
    model_dir = tmp_path / "run 1, lr=0.1 (#2) {a}; ~$%&+@!'"
    est = h.make_estimator(
        model_dir, model_fn=_model_fn, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None
    )
    est.train(h.train_input_fn(x, y), max_steps=2)
    again = h.make_estimator(
        model_dir, model_fn=_model_fn, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None
    )
    assert again.latest_checkpoint() == str(_step_dir(model_dir, 2))
    h.assert_params_close(h.params_of(again), h.params_of(est), rtol=0, atol=0)


# ----------------------------------------------------------------------------- item 9
def test_a_changed_optimizer_is_a_mismatch_not_damage(tmp_path, caplog):
    x, y = h.make_data()
    h.make_estimator(
        tmp_path,
        params={"optimizer": "adam"},
        model_fn=_model_fn,
        ipl=2,
        save_checkpoints_steps=2,
        keep_checkpoint_max=None,
    ).train(h.train_input_fn(x, y), max_steps=4)
    before = _on_disk(tmp_path)
    with caplog.at_level(logging.WARNING, logger="estimator"):
        with pytest.raises(estimator.CheckpointMismatchError, match="train/opt_state") as info:
            h.make_estimator(
                tmp_path,
                params={"optimizer": "adamw"},
                model_fn=_model_fn,
                ipl=2,
                save_checkpoints_steps=2,
                keep_checkpoint_max=None,
            ).train(h.train_input_fn(x, y), max_steps=8)
    assert "different model_fn, params or train_op" in str(info.value)
    assert "unreadable" not in caplog.text and "Skipping" not in caplog.text
    assert _on_disk(tmp_path) == before  # nothing moved aside


def _damage_arrays(step_dir: Path) -> None:
    """Deletes the array data of ``variables`` (the metadata and the JSON meta stay valid)."""
    data = [p for p in (step_dir / "variables").rglob("*") if p.is_file() and "/d/" in str(p)]
    assert data
    for p in data:
        p.unlink()


def test_a_damaged_final_checkpoint_does_not_skip_the_rerun(trained, tmp_path, caplog):
    model_dir = _copy(trained, tmp_path)
    step6 = _step_dir(model_dir, 6)
    _damage_arrays(step6)
    x, y = h.make_data()
    with caplog.at_level(logging.WARNING, logger="estimator"):
        rerun = h.make_estimator(
            model_dir, model_fn=_model_fn, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None
        )
        rerun.train(h.train_input_fn(x, y), max_steps=6)  # the same call again
    assert "Skipping unreadable checkpoint at step 6" in caplog.text
    assert f"{step6.name}.unreadable" in _on_disk(model_dir)  # moved aside, not deleted
    h.assert_params_close(h.params_of(rerun), trained["at6"], rtol=0, atol=0)


def test_a_one_byte_edit_of_the_meta_is_damage(trained, tmp_path, caplog):
    model_dir = _copy(trained, tmp_path)
    path = _step_dir(model_dir, 6) / "meta" / "metadata"
    text = path.read_text()
    assert '"input_pulls": 6' in text
    path.write_text(text.replace('"input_pulls": 6', '"input_pulls": 7'))  # still valid JSON
    x, y = h.make_data()
    with caplog.at_level(logging.WARNING, logger="estimator"):
        resumed = h.make_estimator(
            model_dir, model_fn=_model_fn, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None
        )
        resumed.train(h.train_input_fn(x, y), max_steps=8)
    assert "Skipping unreadable checkpoint at step 6" in caplog.text and "checksum" in caplog.text
    h.assert_params_close(h.params_of(resumed), trained["at8"], rtol=0, atol=0)


def test_a_crafted_input_pulls_is_refused_not_fast_forwarded_forever(trained, tmp_path):
    model_dir = _copy(trained, tmp_path)
    path = _step_dir(model_dir, 6) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps(ckpt_lib.with_checksum({**meta, "input_pulls": 10**15})))
    x, y = h.make_data()
    with _deadline(60), pytest.raises(estimator.CheckpointError, match="input_pulls") as info:
        h.make_estimator(
            model_dir, model_fn=_model_fn, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None
        ).train(h.train_input_fn(x, y), max_steps=8)  # an endless input
    assert "1000000000000000" in str(info.value)
    assert str(_step_dir(model_dir, 6)) in str(info.value)


def _bf16_model_fn(features, labels, mode, params):
    x = features["x"]
    hidden = nn.relu(nn.Dense(16, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x))
    logits = nn.Dense(3, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(hidden)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    ).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.1))


def test_bfloat16_params_train_on_eight_cpu_devices(tmp_path):
    """XLA:CPU aborted compiling the train loop (``Invalid binary instruction opcode copy``)."""
    x, y = h.make_data()
    runs = {}
    for name, use_tpu in (("eight", True), ("one", False)):
        est = estimator.TPUEstimator(
            _bf16_model_fn,
            use_tpu=use_tpu,
            config=h.config(tmp_path / name, iterations_per_loop=1),
            train_batch_size=16,
        )
        est.train(h.train_input_fn(x, y), max_steps=3)
        assert est.num_replicas == (8 if use_tpu else 1)
        runs[name] = h.params_of(est)
    for name, value in runs["eight"].items():
        if name != "global_step":
            assert value.dtype == jnp.bfloat16, name
        # One replica's mean over 16 rows against 8 replicas' means of 2 rows, in bfloat16.
        np.testing.assert_allclose(
            np.asarray(value, np.float32), np.asarray(runs["one"][name], np.float32), atol=0.03
        )
