"""StateStore: one writer per model_dir, readers for other directories, the last state."""

from __future__ import annotations

import numpy as np

from estimator.io.store import LastState, StateStore


def test_writer_is_made_once_and_serves_as_reader(tmp_path):
    store = StateStore(str(tmp_path / "run"), keep_checkpoint_max=2)
    assert store.latest_checkpoint() is None
    writer = store.writer()
    assert store.writer() is writer and store.reader() is writer
    assert store.reader(str(tmp_path / "run" / ".")) is writer  # same directory, spelled apart
    other = store.reader(str(tmp_path / "other"))
    assert other is not writer and other.read_only


def test_saved_steps_and_the_last_state(tmp_path):
    store = StateStore(str(tmp_path), keep_checkpoint_max=2)
    variables = {"params": {"w": np.ones(3, np.float32)}}
    train = {"step": np.int32(0)}
    for step in (1, 2, 3):
        store.writer().save(step, variables, train, {"global_step": step, "input_pulls": step})
    store.writer().wait()
    assert store.writer().steps() == [2, 3]  # keep_checkpoint_max
    assert store.latest_checkpoint() == store.writer().path(3)
    assert store.last is None
    store.remember(LastState(3, "state", {"global_step": 3}))
    assert store.last.step == 3 and store.last.state == "state"
    store.forget()
    assert store.last is None


def test_newest_step_matches_the_full_listing_and_skips_unfinished_steps(tmp_path):
    store = StateStore(str(tmp_path), keep_checkpoint_max=None)
    ckpts = store.writer()
    assert ckpts.newest_step() is None
    variables = {"params": {"w": np.ones(3, np.float32)}}
    for step in (5, 12):
        ckpts.save(step, variables, {"step": np.int32(step)}, {"global_step": step})
    ckpts.wait()
    # A save in progress (Orbax's temporary name) and an unrelated entry are not steps.
    (tmp_path / "model.ckpt-20.orbax-checkpoint-tmp-123").mkdir()
    (tmp_path / "model.ckpt-30").write_text("not a directory")
    assert ckpts.newest_step() == ckpts.steps()[-1] == 12
