"""Damaged checkpoints are never loaded: the previous good one is used (with a warning naming
the skipped step), or a clear error when none is good; nothing already saved is deleted.

Every case damages the newest of three real checkpoints (steps 2, 4, 6) on disk the way a
crash, a full disk or a bad copy would, then checks what ``evaluate`` and ``train`` do against
independent references: an evaluation of the untouched step 4 and an uninterrupted run.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from estimator.io import checkpoint as ckpt_lib
from tests import helpers as h

STEPS = (2, 4, 6)
# Orbax's asyncio helpers print "Event loop is closed" after a failed read; that is noise.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model_dir with checkpoints 2, 4, 6; the eval results of step 4; params of step 8."""
    x, y = h.make_data()
    base = tmp_path_factory.mktemp("base")
    h.make_estimator(
        base, params={"batch_norm": True}, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None
    ).train(h.train_input_fn(x, y), max_steps=6)
    at4 = h.make_estimator(
        base, params={"batch_norm": True}, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None
    ).evaluate(h.eval_input_fn(x, y), checkpoint_path=str(base / "model.ckpt-4"))
    ref = tmp_path_factory.mktemp("reference")
    reference = h.make_estimator(
        ref, params={"batch_norm": True}, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None
    )
    reference.train(h.train_input_fn(x, y), max_steps=8)
    return {"dir": base, "eval_at_4": at4, "params_at_8": h.params_of(reference), "data": (x, y)}


def _copy(trained, tmp_path) -> Path:
    model_dir = tmp_path / "model"
    shutil.copytree(trained["dir"], model_dir)
    return model_dir


def _snapshot(root: Path) -> dict[str, str]:
    """relative path -> sha1 of every file under ``root`` (what is on disk, byte for byte)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(root))] = hashlib.sha1(path.read_bytes()).hexdigest()
    return out


def _checkpoints_snapshot(model_dir: Path) -> dict[str, str]:
    """``_snapshot`` of every checkpoint step directory (and moved-aside or unfinished one)."""
    out = {}
    for step_dir in sorted(model_dir.glob("model.ckpt-*")):
        out.update({f"{step_dir.name}/{k}": v for k, v in _snapshot(step_dir).items()})
    return out


def _truncate(pattern: str):
    def damage(step_dir: Path):
        files = glob.glob(str(step_dir / pattern))
        assert files, pattern
        for f in files:
            with open(f, "r+b") as fh:
                fh.truncate(os.path.getsize(f) // 2)

    return damage


def _write(name: str, content: bytes):
    def damage(step_dir: Path):
        assert (step_dir / name).exists(), name
        (step_dir / name).write_bytes(content)

    return damage


def _remove(pattern: str):
    def damage(step_dir: Path):
        paths = glob.glob(str(step_dir / pattern))
        assert paths, pattern
        for p in paths:
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)

    return damage


def _flip_bytes(step_dir: Path):
    for f in glob.glob(str(step_dir / "variables" / "d" / "*")):
        data = bytearray(Path(f).read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 8):
            data[i] ^= 0xFF
        Path(f).write_bytes(bytes(data))


def _emptied(step_dir: Path):
    shutil.rmtree(step_dir)
    step_dir.mkdir()


DAMAGE = {
    "truncated variables data": _truncate("variables/d/*"),
    "flipped bytes in variables data": _flip_bytes,
    "variables data file deleted": _remove("variables/d/*"),
    "variables item deleted": _remove("variables"),
    "meta item deleted": _remove("meta"),
    "train item deleted": _remove("train"),
    "empty step directory": _emptied,
    "garbage _CHECKPOINT_METADATA": _write("_CHECKPOINT_METADATA", b"garbage{{"),
    "garbage OCDBT manifest": _write("variables/manifest.ocdbt", b"\x00garbage"),
    "garbage variables/_METADATA": _write("variables/_METADATA", b"not json"),
    "garbage meta": _write("meta/metadata", b"not json"),
    "meta naming another step": _write(
        "meta/metadata", json.dumps({"global_step": 5, "input_pulls": 5}).encode()
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_evaluate_skips_a_damaged_checkpoint(trained, tmp_path, caplog, damage):
    model_dir = _copy(trained, tmp_path)
    DAMAGE[damage](model_dir / "model.ckpt-6")
    before = _checkpoints_snapshot(model_dir)
    x, y = trained["data"]
    with caplog.at_level(logging.WARNING, logger="estimator"):
        results = h.make_estimator(
            model_dir,
            params={"batch_norm": True},
            ipl=2,
            save_checkpoints_steps=2,
            keep_checkpoint_max=None,
        ).evaluate(h.eval_input_fn(x, y))
    assert results == trained["eval_at_4"]
    assert any("step 6" in r.getMessage() for r in caplog.records), caplog.text
    assert _checkpoints_snapshot(model_dir) == before  # a reader changes nothing


TRAIN_CASES = [
    "truncated variables data",
    "train item deleted",
    "garbage OCDBT manifest",
    "meta naming another step",
]


def _truncated_train_data(step_dir: Path):
    _truncate("train/d/*")(step_dir)


@pytest.mark.parametrize("damage", TRAIN_CASES + ["truncated train data"])
def test_train_resumes_from_the_previous_good_checkpoint(trained, tmp_path, caplog, damage):
    model_dir = _copy(trained, tmp_path)
    step6 = model_dir / "model.ckpt-6"
    (DAMAGE.get(damage) or _truncated_train_data)(step6)
    damaged = _snapshot(step6)
    kept = {s: _snapshot(model_dir / f"model.ckpt-{s}") for s in (2, 4)}
    x, y = trained["data"]
    est = h.make_estimator(
        model_dir,
        params={"batch_norm": True},
        ipl=2,
        save_checkpoints_steps=2,
        keep_checkpoint_max=None,
    )
    with caplog.at_level(logging.WARNING, logger="estimator"):
        est.train(h.train_input_fn(x, y), max_steps=8)
    assert any(
        "Skipping unreadable checkpoint at step 6" in r.getMessage() for r in caplog.records
    ), caplog.text
    # Resumed from step 4 with the input repositioned: exactly the uninterrupted run.
    h.assert_params_close(h.params_of(est), trained["params_at_8"], rtol=0, atol=0)
    # Nothing saved was deleted: the damaged step was moved aside byte for byte.
    assert _snapshot(model_dir / "model.ckpt-6.unreadable") == damaged
    for s, snap in kept.items():
        assert _snapshot(model_dir / f"model.ckpt-{s}") == snap
    assert est.get_variable_value("global_step") == 8


def test_no_readable_checkpoint_is_an_error_never_a_fresh_start(trained, tmp_path):
    model_dir = _copy(trained, tmp_path)
    for s in STEPS:
        DAMAGE["garbage OCDBT manifest"](model_dir / f"model.ckpt-{s}")
    before = _snapshot(model_dir)
    x, y = trained["data"]
    with pytest.raises(ckpt_lib.CheckpointError, match="no readable checkpoint"):
        h.make_estimator(
            model_dir,
            params={"batch_norm": True},
            ipl=2,
            save_checkpoints_steps=2,
            keep_checkpoint_max=None,
        ).evaluate(h.eval_input_fn(x, y))
    with pytest.raises(ckpt_lib.CheckpointError, match="refusing to start over"):
        h.make_estimator(
            model_dir,
            params={"batch_norm": True},
            ipl=2,
            save_checkpoints_steps=2,
            keep_checkpoint_max=None,
        ).train(h.train_input_fn(x, y), max_steps=10)
    assert _snapshot(model_dir) == before  # nothing moved aside, deleted or written


def test_get_variable_value_reads_the_newest_readable_checkpoint(trained, tmp_path, caplog):
    model_dir = _copy(trained, tmp_path)
    DAMAGE["truncated variables data"](model_dir / "model.ckpt-6")
    with caplog.at_level(logging.WARNING, logger="estimator"):
        assert (
            h.make_estimator(
                model_dir,
                params={"batch_norm": True},
                ipl=2,
                save_checkpoints_steps=2,
                keep_checkpoint_max=None,
            ).get_variable_value("global_step")
            == 4
        )
    assert "step 6" in caplog.text


def test_reader_ignores_and_keeps_an_unfinished_write(trained, tmp_path):
    model_dir = _copy(trained, tmp_path)
    unfinished = model_dir / "model.ckpt-8.orbax-checkpoint-tmp"
    shutil.copytree(model_dir / "model.ckpt-6", unfinished)
    shutil.rmtree(unfinished / "variables")
    x, y = trained["data"]
    assert (
        h.make_estimator(
            model_dir,
            params={"batch_norm": True},
            ipl=2,
            save_checkpoints_steps=2,
            keep_checkpoint_max=None,
        ).evaluate(h.eval_input_fn(x, y))["global_step"]
        == 6
    )
    assert unfinished.is_dir()  # only a trainer cleans up its own unfinished writes


def test_a_step_removed_while_being_read_is_not_reported_as_damaged(trained, tmp_path, caplog):
    """A trainer rotating old checkpoints away under a reader: the reader moves on quietly."""
    model_dir = _copy(trained, tmp_path)
    ckpts = ckpt_lib.Checkpoints(str(model_dir), read_only=True)
    real_restore = ckpts.restore

    def restore_while_rotated(step, **kw):
        if step == 6 and (model_dir / "model.ckpt-6").exists():
            shutil.rmtree(model_dir / "model.ckpt-6")  # what keep_checkpoint_max does
        return real_restore(step, **kw)

    ckpts.restore = restore_while_rotated
    with caplog.at_level(logging.WARNING, logger="estimator"):
        step, out = ckpts.restore_latest()
    assert step == 4 and out["meta"]["global_step"] == 4
    assert "unreadable" not in caplog.text
