"""``evaluate`` on a model_dir it cannot write (issue 30, item 3).

A real read-only directory: as root (whom permissions do not stop), a read-only bind mount of
the model_dir; as another user, the directory's write bits removed. Skipped where neither can
be made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests import helpers as h


@contextlib.contextmanager
def read_only(path: Path):
    """Makes ``path`` really unwritable for this process while the block runs."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        for p in [path, *path.rglob("*")]:
            p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        try:
            yield
        finally:
            for p in [path, *path.rglob("*")]:
                p.chmod(p.stat().st_mode | stat.S_IWUSR)
            path.chmod(mode)
        return
    bind = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
    if bind.returncode != 0:
        pytest.skip(f"cannot make a read-only directory as root: {bind.stderr!r}")
    try:
        ro = subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], capture_output=True)
        if ro.returncode != 0:
            pytest.skip(f"cannot remount read-only: {ro.stderr!r}")
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_evaluate_on_a_read_only_model_dir_evaluates_and_says_once(tmp_path, caplog):
    x, y = h.make_data()
    model_dir = tmp_path / "run"
    est = h.make_estimator(model_dir)
    est.train(h.train_input_fn(x, y), max_steps=4)
    with read_only(model_dir):
        with pytest.raises(OSError):
            (model_dir / "probe").write_text("")  # really read-only
        with caplog.at_level(logging.WARNING, logger="estimator"):
            got = est.evaluate(h.eval_input_fn(x, y), steps=2)  # failed writing eval/ before
            again = est.evaluate(h.eval_input_fn(x, y), steps=2)
        assert not (model_dir / "eval").exists()
    said = [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(said) == 1, caplog.text  # once, not per evaluation
    assert str(model_dir / "eval") in said[0]
    # The same numbers as an evaluation that could write its events.
    want = est.evaluate(h.eval_input_fn(x, y), steps=2)
    assert (model_dir / "eval").exists()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], err_msg=key)
        np.testing.assert_allclose(again[key], want[key], err_msg=key)
