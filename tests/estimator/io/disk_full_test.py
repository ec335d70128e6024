"""A disk that fills up during training (issue 30, item 7): a real, small tmpfs.

Before: Orbax's two ERROR records with tracebacks (about 100 lines) and a bare ``ENOSPC``
from the summary writer, without a path. Now: one error naming the checkpoint that could not
be written and the newest intact one; every checkpoint saved before reads back.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from estimator.io import checkpoint as ckpt_lib
from estimator.io import disk_full

ROOT = Path(__file__).resolve().parents[3]

_JOB = """
import sys
from tests import helpers as h
x, y = h.make_data()
est = h.make_estimator(
    sys.argv[1], ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None, params={"hidden": 64}
)
est.train(h.train_input_fn(x, y), max_steps=400)
"""


@pytest.fixture
def small_disk(tmp_path):
    """A 600 KiB tmpfs (root only; skipped where it cannot be mounted)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr!r}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_is_one_error_naming_the_checkpoint_and_nothing_saved_is_lost(small_disk):
    model_dir = small_disk / "run"
    run = subprocess.run(
        [sys.executable, "-c", _JOB, str(model_dir)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    ours = [ln for ln in run.stderr.splitlines() if not ln.startswith(("I1", "W1", "E1"))]
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.stderr.count("Traceback") == 1, run.stderr[-6000:]  # ours, not Orbax's
    assert "ERROR:absl" not in run.stderr, run.stderr[-6000:]
    last = ours[-1]
    assert last.startswith("OSError: [Errno 28] No space left on device: checkpoint "), last
    ckpts = ckpt_lib.Checkpoints(str(model_dir), read_only=True)
    steps = ckpts.steps()
    assert steps and f"newest: step {steps[-1]}" in last
    assert f"model.ckpt-{steps[-1] + 2}" in last  # the step that could not be written
    for step in steps:  # everything saved before reads back, array by array
        assert ckpts.verify(step)["global_step"] == step
    assert len(ours) < 40, "\n".join(ours)


def test_disk_full_is_recognised_through_orbax_and_tensorstore_errors():
    ts = ValueError('RESOURCE_EXHAUSTED: Error writing local file "/x/manifest.ocdbt"')
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = ts
    assert disk_full.is_disk_full(wrapped)
    assert disk_full.is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not disk_full.is_disk_full(OSError(errno.EACCES, "Permission denied"))
    error = disk_full.disk_full_error("/runs/a/model.ckpt-12", intact_step=10)
    assert error.errno == errno.ENOSPC and error.filename == "/runs/a/model.ckpt-12"


def _fill(disk: Path) -> None:
    """Writes one file until the disk has no block left."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_disk_full_at_start_names_the_model_dir(small_disk):
    """Issue 42: the trainer's first write into model_dir (its lock file) used to raise a
    bare ``OSError: [Errno 28] No space left on device`` without a path."""
    from tests import helpers as h

    _fill(small_disk)
    model_dir = small_disk / "run"
    x, y = h.make_data(n=32)
    est = h.make_estimator(str(model_dir), ipl=2)
    with pytest.raises(OSError) as raised:
        est.train(h.train_input_fn(x, y), max_steps=2)
    assert raised.value.errno == errno.ENOSPC
    message = str(raised.value)
    assert f"cannot write its lock file in model_dir {model_dir}" in message, message
    assert "Free space on that disk" in message


def test_the_cli_finds_a_full_disk_before_jax(small_disk):
    _fill(small_disk)
    model_dir = small_disk / "cli" / "run"
    probe = (
        "import io, sys; from estimator.cli import main; "
        "status = main(sys.argv[1:], out=io.StringIO()); "
        "print('JAX' if 'jax' in sys.modules else 'no JAX', status)"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe, "train", "--model_dir", str(model_dir)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.stdout.split() == ["no", "JAX", "2"], run.stdout + run.stderr
    assert run.stderr.strip() == (
        f"tpu-estimator: error: --model_dir {model_dir}: cannot write there (No space left on "
        "device); free space on its disk"
    )
    assert not (small_disk / "cli").exists()  # the directories it made are removed again


def test_an_export_on_a_full_disk_names_the_export_and_keeps_the_earlier_one(small_disk, tmp_path):
    """Issue 42: an export on a full disk raised TF's raw ``ResourceExhaustedError``."""
    from estimator.io import export
    from tests import helpers as h

    x, y = h.make_data(n=32)
    est = h.make_estimator(str(tmp_path / "run"), ipl=2)
    est.train(h.train_input_fn(x, y), max_steps=2)
    serving = export.build_raw_serving_input_receiver_fn({"x": x[:16]})
    base = small_disk / "exports"
    first = est.export_saved_model(str(base), serving)
    before = export.load_saved_model(first)({"x": x[:16]})["logits"]
    _fill(small_disk)
    with pytest.raises(OSError) as raised:
        est.export_saved_model(str(base), serving)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(base)
    message = str(raised.value)
    assert f"the export into {base} could not be written" in message, message
    assert "earlier exports are intact" in message
    assert os.listdir(base) == [os.path.basename(first)]  # no half-written temp- folder
    after = export.load_saved_model(first)({"x": x[:16]})["logits"]
    np.testing.assert_array_equal(after, before)
