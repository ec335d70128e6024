"""A killed export's ``temp-<timestamp>`` folder is removed by the next export (issue 30, 7).

The export is killed for real (SIGKILL, from inside ``np.savez`` in a subprocess, so it dies
mid-write); a temp folder of an export still running (its lock held) is left alone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from estimator.io import export as export_lib
from estimator.io import export_temp
from tests import helpers as h

ROOT = Path(__file__).resolve().parents[3]

_KILLED_EXPORT = """
import os, signal, sys
import numpy as np
from estimator.io.export import build_raw_serving_input_receiver_fn
from tests import helpers as h
est = h.make_estimator(sys.argv[1])
np.savez = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # dies mid-export
fn = build_raw_serving_input_receiver_fn({"x": np.zeros((1, 6), np.float32)})
est.export_saved_model(sys.argv[2], fn)
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    x, y = h.make_data()
    model_dir = tmp_path_factory.mktemp("run")
    est = h.make_estimator(model_dir)
    est.train(h.train_input_fn(x, y), max_steps=4)
    return est


def _fn():
    return export_lib.build_raw_serving_input_receiver_fn({"x": np.zeros((1, 6), np.float32)})


def test_a_killed_exports_temp_folder_is_removed_by_the_next_export(trained, tmp_path, caplog):
    base = tmp_path / "export"
    run = subprocess.run(
        [sys.executable, "-c", _KILLED_EXPORT, trained.model_dir, str(base)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        timeout=300,
    )
    assert run.returncode == -9, run.stderr[-2000:]
    (left,) = [p for p in base.iterdir() if p.name.startswith("temp-")]  # what it left
    with caplog.at_level(logging.INFO, logger="estimator"):
        path = trained.export_saved_model(str(base), _fn())
    assert not left.exists()  # nothing removed it before
    assert str(left) in caplog.text
    assert sorted(p.name for p in base.iterdir()) == [os.path.basename(path)]
    assert export_lib.load_saved_model(path) is not None


def test_the_temp_folder_of_an_export_still_running_is_kept(trained, tmp_path):
    base = tmp_path / "export"
    running = base / "temp-1700000000"
    running.mkdir(parents=True)
    fd = os.open(running / export_temp.EXPORTING_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live writer holds it
    try:
        path = trained.export_saved_model(str(base), _fn())
        assert running.exists() and os.path.isdir(path)
    finally:
        os.close(fd)
    trained.export_saved_model(str(base), _fn())  # its writer is gone now: removed
    assert not running.exists()
