"""The training checkpointer (``driver/checkpointer.py``) fed a state directly.

It saves when due by steps and by seconds, never twice a step, writes the meta with the
input position, and calls listeners around each save. What it wrote is read back with Orbax
and ``json`` directly (not through ``io/checkpoint.py``). Time is driven through a fake clock
patched over the module's ``time``: the module has no clock argument to inject one.

The checkpointer is built in one place, ``_make``, and fed in one, ``_trained``: the only
lines that know its constructor and what it is handed.
"""

from __future__ import annotations

import json
import logging
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import estimator
from estimator.core.spec import ModeKeys
from estimator.driver import checkpointer as checkpointer_lib
from estimator.driver.checkpointer import (
    Checkpointer,
    Position,
    Trained,
    save_then_drain,
    wait_committed,
)
from estimator.driver.hook_runner import Session
from estimator.engine.loops import TrainState
from estimator.io.checkpoint import Checkpoints
from estimator.io.input_position import PROCESSES_KEY, ROWS_KEY
from estimator.io.store import StateStore

_OPEN: list[Checkpoints] = []


def _make(tmp_path, listeners=(), *, last_step=None, pulls_per_step=1, rows=None, **cfg):
    """A checkpointer writing to ``tmp_path``; ``cfg`` goes to ``RunConfig``."""
    config = estimator.RunConfig(model_dir=str(tmp_path), **cfg)
    ckpts = Checkpoints(str(tmp_path), max_to_keep=None)
    _OPEN.append(ckpts)
    store = StateStore(str(tmp_path), keep_checkpoint_max=None)
    session = Session(mode=ModeKeys.TRAIN, model_dir=str(tmp_path), global_step=0)
    return Checkpointer(
        config,
        ckpts,
        store,
        session,
        listeners,
        last_step=last_step,
        pulls_per_step=pulls_per_step,
        rows_per_pull=rows,
    )


def _trained(step: int, pulls: int | None = None, input_state=None) -> Trained:
    """What a loop ending at ``step`` hands on (``pulls`` batches read: ``step`` unless
    given)."""
    position = Position(input_pulls=step if pulls is None else pulls, input_state=input_state)
    return Trained(step, _state(step), position)


def _state(step: int) -> TrainState:
    params = {"dense": {"kernel": jnp.full((2, 3), float(step)), "bias": jnp.arange(3.0)}}
    return TrainState(
        params=params,
        state={"batch_stats": {"mean": jnp.arange(3.0) + step}},
        opt_state=optax.adam(0.1).init(params),
        step=jnp.int32(step),
        rng=jnp.array([0, step], jnp.uint32),
        nonfinite=jnp.int32(step // 4),
    )


class Clock:
    """A fake ``time`` module: ``monotonic()`` returns what the test set."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(checkpointer_lib, "time", types.SimpleNamespace(monotonic=fake.monotonic))
    return fake


@pytest.fixture(autouse=True)
def close_checkpoints():
    """Closes every writer a test made (Orbax's manager keeps threads until closed)."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def _train_to(saver: Checkpointer, steps) -> list[int]:
    """Hands the saver each loop end of ``steps``, asking to save after each; returns the
    steps written."""
    for step in steps:
        saver.maybe_save(_trained(step))
    saver.ckpts.wait()
    return saver.ckpts.steps()


@pytest.mark.parametrize(
    "every, loop_ends, saved",
    [
        (3, range(1, 11), [3, 6, 9]),
        (4, [2, 4, 6, 8, 10], [4, 8]),
        (5, [3, 6, 9, 12], [6, 12]),  # counted from the last save, not at multiples
        (1, [4, 8], [4, 8]),
        (10, [3, 6, 9], []),
    ],
)
def test_saves_when_due_by_steps(tmp_path, every, loop_ends, saved):
    assert _train_to(_make(tmp_path, save_checkpoints_steps=every), loop_ends) == saved


@pytest.mark.parametrize(
    "last_step, loop_ends, saved",
    [
        (4, [5, 6, 7, 8], [7]),  # counted from the checkpoint already there
        (4, [4, 5, 6], []),  # its own step is not written again
        (None, [1, 2, 3], [3]),  # none yet: counted from step 0
    ],
)
def test_the_step_cadence_counts_from_the_newest_checkpoint(tmp_path, last_step, loop_ends, saved):
    saver = _make(tmp_path, last_step=last_step, save_checkpoints_steps=3)
    assert _train_to(saver, loop_ends) == saved


@pytest.mark.parametrize(
    "every, ticks, saved",
    [
        # (step, seconds since the checkpointer was made)
        (60.0, [(2, 30), (4, 61), (6, 100), (8, 121), (10, 150)], [4, 8]),
        (60.0, [(2, 59.9), (4, 60.0)], [4]),  # due at exactly the interval
        (10.0, [(1, 5), (2, 10), (3, 15), (4, 20)], [2, 4]),
        (600.0, [(1, 100), (2, 500)], []),
    ],
)
def test_saves_when_due_by_seconds_on_a_fake_clock(tmp_path, clock, every, ticks, saved):
    start = clock.now
    saver = _make(tmp_path, save_checkpoints_secs=every)
    for step, seconds in ticks:
        clock.now = start + seconds
        saver.maybe_save(_trained(step))
    saver.ckpts.wait()
    assert saver.ckpts.steps() == saved


def test_the_default_cadence_is_every_600_seconds(tmp_path, clock):
    start = clock.now
    saver = _make(tmp_path)
    for step, seconds in [(1, 599), (2, 600), (3, 900)]:
        clock.now = start + seconds
        saver.maybe_save(_trained(step))
    saver.ckpts.wait()
    assert saver.ckpts.steps() == [2]


def _read_back(path: str) -> tuple[dict, dict, dict]:
    """(variables, train, meta) of a checkpoint step directory, read with Orbax and json."""
    reader = ocp.StandardCheckpointer()
    variables = reader.restore(os.path.join(path, "variables"))
    train = reader.restore(os.path.join(path, "train"))
    with open(os.path.join(path, "meta", "metadata")) as f:
        meta = json.load(f)
    return variables, train, meta


def _values(tree) -> np.ndarray:
    return np.sort(np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)]))


def test_saved_state_reads_back_with_orbax(tmp_path):
    saver = _make(tmp_path, save_checkpoints_steps=5)
    _train_to(saver, [5])
    variables, train, meta = _read_back(saver.ckpts.path(5))
    want = _state(5)
    assert os.path.basename(saver.ckpts.path(5)) == "model.ckpt-5"  # TF's name
    np.testing.assert_array_equal(
        variables["params"]["dense"]["kernel"], want.params["dense"]["kernel"]
    )
    np.testing.assert_array_equal(
        variables["params"]["dense"]["bias"], want.params["dense"]["bias"]
    )
    np.testing.assert_array_equal(
        variables["batch_stats"]["mean"], want.state["batch_stats"]["mean"]
    )
    assert int(train["step"]) == 5 and int(train["nonfinite"]) == 1
    np.testing.assert_array_equal(train["rng"], np.array([0, 5], np.uint32))
    # Restored without a template, the optimizer state's containers are Orbax's: compare
    # its values.
    np.testing.assert_array_equal(_values(train["opt_state"]), _values(want.opt_state))
    assert meta["global_step"] == 5 and meta["input_pulls"] == 5


@pytest.mark.parametrize(
    "step, pulls, pulls_per_step, rows, input_state, expected",
    [
        (6, 6, 1, None, None, {"global_step": 6, "input_pulls": 6, "skipped_pulls": 0}),
        # two short batches skipped on the way: pulls beyond the steps' own
        (6, 8, 1, None, None, {"global_step": 6, "input_pulls": 8, "skipped_pulls": 2}),
        # a step takes two pulls (micro-batches); never a negative skip
        (6, 12, 2, None, None, {"global_step": 6, "input_pulls": 12, "skipped_pulls": 0}),
        (6, 10, 2, None, None, {"global_step": 6, "input_pulls": 10, "skipped_pulls": 0}),
        (
            4,
            4,
            1,
            32,
            {"epoch": 1, "offset": 7},
            {
                "global_step": 4,
                "input_pulls": 4,
                "skipped_pulls": 0,
                ROWS_KEY: 32,
                PROCESSES_KEY: 1,  # how many processes read the input (a resume converts)
                "input_state": {"epoch": 1, "offset": 7},
            },
        ),
    ],
)
def test_meta_records_the_input_position(
    tmp_path, step, pulls, pulls_per_step, rows, input_state, expected
):
    trained = _trained(step, pulls, input_state)
    saver = _make(tmp_path, pulls_per_step=pulls_per_step, rows=rows)
    assert saver.meta(trained) == expected
    saver.save(trained)
    saver.ckpts.wait()
    _, _, meta = _read_back(saver.ckpts.path(step))
    assert {k: meta[k] for k in expected} == expected
    assert "checksum" in meta  # the stored meta is checksummed


def test_never_saves_a_step_twice(tmp_path):
    log = []
    saver = _make(tmp_path, [_Listener(log)], save_checkpoints_steps=2)
    _train_to(saver, [1, 2])
    # the end-of-training save of the same step
    assert saver.save(_trained(2)) == saver.ckpts.path(2)
    saver.ckpts.wait()
    assert saver.ckpts.steps() == [2]
    assert [e[:2] for e in log] == [("before", 2), ("after", 2)]  # listeners once


class _Listener:
    """Records ``before_save`` / ``after_save`` and what the store holds during the latter."""

    def __init__(self, log: list, *, stop_after: int | None = None, store=None):
        self.log, self.stop_after, self.store = log, stop_after, store
        self.sessions: list = []

    def before_save(self, session, step):
        self.sessions.append(session)
        self.log.append(("before", step, None))

    def after_save(self, session, step):
        self.sessions.append(session)
        last = None if self.store is None else self.store.last
        seen = None if last is None else (last.step, int(last.state.step), last.meta)
        self.log.append(("after", step, seen))
        return self.stop_after is not None and step >= self.stop_after


def test_listeners_are_called_around_each_save_and_see_the_saved_state(tmp_path):
    log: list = []
    saver = _make(tmp_path, save_checkpoints_steps=2)
    saver.listeners = [_Listener(log, store=saver.store), _Listener(log, stop_after=4)]
    _train_to(saver, [2, 3])
    assert not saver.stop_requested
    _train_to(saver, [4])
    assert saver.stop_requested  # the second listener returned True at step 4
    befores = [e[1] for e in log if e[0] == "before"]
    assert befores == [2, 2, 4, 4]
    seen = [e[2] for e in log if e[0] == "after" and e[2] is not None]
    assert [s[:2] for s in seen] == [(2, 2), (4, 4)]
    assert seen[0][2] == {"global_step": 2, "input_pulls": 2, "skipped_pulls": 0}
    # Order per save: every before_save, then the write, then every after_save.
    kinds = [e[0] for e in log]
    assert kinds == ["before", "before", "after", "after"] * 2
    assert saver.store.last is None  # forgotten: the state goes on to be donated
    assert all(s is saver.session for listener in saver.listeners for s in listener.sessions)


def test_a_listener_error_still_forgets_the_state(tmp_path):
    class Failing:
        def before_save(self, session, step):
            pass

        def after_save(self, session, step):
            raise RuntimeError("evaluation failed")

    saver = _make(tmp_path, [Failing()], save_checkpoints_steps=1)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        _train_to(saver, [1])
    assert saver.store.last is None


class _Worker:
    def __init__(self, drained: bool, queued=()):
        self.drained, self.queued, self.calls = drained, list(queued), []

    def drain(self, timeout):
        self.calls.append(("drain", timeout))
        return self.drained

    def cancel(self):
        self.calls.append(("cancel",))
        return self.queued

    def check(self):
        self.calls.append(("check",))


@pytest.mark.parametrize(
    "drained, queued, warned",
    [
        (True, [], None),
        (False, [None], None),  # nothing real left: no warning
        (False, [(5, 8), (9, 12), None], "host_call skipped for steps 5-12 (2 loops"),
    ],
)
def test_save_then_drain_commits_first_then_drains(tmp_path, caplog, drained, queued, warned):
    saver = _make(tmp_path, save_checkpoints_steps=100)
    worker = _Worker(drained, queued)
    with caplog.at_level(logging.WARNING, logger="estimator"):
        save_then_drain(saver, worker, _trained(7))
    assert Checkpoints(str(tmp_path), read_only=True).steps() == [7]  # committed on return
    names = [c[0] for c in worker.calls]
    assert names == (["drain", "check"] if drained else ["drain", "cancel", "check"])
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if warned is None:
        assert not any("host_call skipped" in m for m in messages)
    else:
        assert any(warned in m for m in messages)


def test_wait_committed_waits_again_through_a_second_ctrl_c():
    waits = []

    class Ckpts:
        def wait(self):
            waits.append(1)
            if len(waits) == 1:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        wait_committed(Ckpts())
    assert len(waits) == 2
