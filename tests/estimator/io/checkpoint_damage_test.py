"""Damaged checkpoint metas that used to pass or crash (issue 30, items 5 and 7).

A meta whose ``checksum`` entry was deleted was trusted as a checkpoint from before checksums;
a meta nested 100,000 levels deep raised a raw ``RecursionError``; the fallback from a
damaged step printed Orbax's ``Event loop is closed`` and, at random, asyncio's
``Task exception was never retrieved`` tracebacks (CI failed on the second). Each damaged
step must be skipped for the next newest (compared bitwise with an uninterrupted run), moved
aside, never deleted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from estimator.io import checkpoint as ckpt_lib
from estimator.io import meta_format, orbax_noise
from estimator.io import model_dir as model_dir_lib
from tests import helpers as h

ROOT = Path(__file__).resolve().parents[3]
X, Y = h.make_data()


def _est(model_dir):
    return h.make_estimator(model_dir, ipl=2, save_checkpoints_steps=2, keep_checkpoint_max=None)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Checkpoints 2, 4, 6 of a run, and the params of an uninterrupted run to step 8."""
    base = tmp_path_factory.mktemp("trained")
    _est(base / "run").train(h.train_input_fn(X, Y), max_steps=6)
    to8 = _est(base / "to8")
    to8.train(h.train_input_fn(X, Y), max_steps=8)
    return {"dir": base / "run", "at8": h.params_of(to8)}


def _copy(trained, tmp_path) -> Path:
    shutil.copytree(trained["dir"], tmp_path / "run")
    return tmp_path / "run"


def _meta_path(model_dir, step: int) -> Path:
    step_dir = ckpt_lib.Checkpoints(str(model_dir), read_only=True).path(step)
    return Path(step_dir) / "meta" / "metadata"


def _resume_to_8(model_dir, caplog) -> dict:
    with caplog.at_level(logging.WARNING, logger="estimator"):
        est = _est(model_dir)
        est.train(h.train_input_fn(X, Y), max_steps=8)
    return h.params_of(est)


def _assert_equal(got, want):
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _moved_aside(model_dir, step: int) -> bool:
    names = os.listdir(model_dir_lib.checkpoint_dir(str(model_dir)))
    return any(n.endswith(".unreadable") and str(step) in n for n in names)


def test_a_meta_whose_checksum_was_deleted_is_damage(trained, tmp_path, caplog):
    model_dir = _copy(trained, tmp_path)
    path = _meta_path(model_dir, 6)
    meta = json.loads(path.read_text())
    del meta["checksum"]
    path.write_text(json.dumps({**meta, "input_pulls": 7}))  # and now an edit goes unseen
    got = _resume_to_8(model_dir, caplog)
    assert "Skipping unreadable checkpoint at step 6" in caplog.text
    assert "no checksum" in caplog.text
    assert _moved_aside(model_dir, 6)
    _assert_equal(got, trained["at8"])


def test_a_meta_in_the_format_from_before_checksums_is_still_read(trained, tmp_path, caplog):
    model_dir = _copy(trained, tmp_path)
    path = _meta_path(model_dir, 6)
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({"global_step": 6, "input_pulls": meta["input_pulls"]}))
    got = _resume_to_8(model_dir, caplog)
    assert "Skipping unreadable" not in caplog.text and not _moved_aside(model_dir, 6)
    _assert_equal(got, trained["at8"])


def test_a_meta_nested_100000_deep_is_damage_not_a_recursion_error(trained, tmp_path, caplog):
    model_dir = _copy(trained, tmp_path)
    path = _meta_path(model_dir, 6)
    meta = json.loads(path.read_text())
    deep = "[" * 100_000 + "]" * 100_000
    text = json.dumps({**meta, "input_state": "DEEP"}).replace('"DEEP"', deep)
    path.write_text(text)
    got = _resume_to_8(model_dir, caplog)  # RecursionError before
    assert "Skipping unreadable checkpoint at step 6" in caplog.text
    assert "nested" in caplog.text
    _assert_equal(got, trained["at8"])


def test_a_meta_nested_deeper_than_the_bound_is_damage(trained, tmp_path, caplog):
    model_dir = _copy(trained, tmp_path)  # deep enough to name, not to crash the parser
    path = _meta_path(model_dir, 6)
    meta = json.loads(path.read_text())
    state: list = []
    for _ in range(meta_format.MAX_META_DEPTH + 5):
        state = [state]
    path.write_text(json.dumps(meta_format.with_checksum({**meta, "input_state": state})))
    got = _resume_to_8(model_dir, caplog)
    assert f"more than {meta_format.MAX_META_DEPTH} levels" in caplog.text
    _assert_equal(got, trained["at8"])


_FALLBACK = """
import sys
from tests.estimator.io import checkpoint_damage_test as t
est = t._est(sys.argv[1])
for _ in range(6):  # the noise comes from a race: read the damaged step several times
    est.evaluate(t.h.eval_input_fn(t.X, t.Y), steps=1)
est.train(t.h.train_input_fn(t.X, t.Y), max_steps=8)
print("TRAINED")
"""


def _flip_bytes(step_dir: Path) -> None:
    for f in (step_dir / "variables" / "d").iterdir():
        data = bytearray(f.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 8):
            data[i] ^= 0xFF
        f.write_bytes(bytes(data))


def test_the_fallback_from_a_damaged_step_prints_no_event_loop_tracebacks(trained, tmp_path):
    model_dir = _copy(trained, tmp_path)
    _flip_bytes(Path(ckpt_lib.Checkpoints(str(model_dir), read_only=True).path(6)))
    run = subprocess.run(
        [sys.executable, "-c", _FALLBACK, str(model_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=300,
    )
    assert run.returncode == 0 and "TRAINED" in run.stdout, run.stderr[-3000:]
    assert "Skipping unreadable checkpoint at step 6" in run.stderr
    assert "Event loop is closed" not in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]


def test_the_noise_filter_drops_only_the_closed_loop_callback_error():
    import asyncio

    seen = []
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as e:
        closed = e
    other = RuntimeError("Event loop is closed")  # the same words, raised elsewhere

    class U:
        def __init__(self, e):
            self.exc_value, self.exc_traceback, self.object = e, e.__traceback__, None

    seen = [orbax_noise.is_closed_loop_noise(U(e)) for e in (closed, other)]
    assert seen == [True, False]


class _Failing:
    """An awaitable that is not a coroutine (as TensorStore's futures are), failing at once."""

    def __init__(self, message):
        self.message = message

    def __await__(self):
        raise ValueError(self.message)
        yield  # a generator, so ``await`` accepts it


def _unretrieved_errors_logged(message, caplog) -> list[str]:
    """Awaits the first of two failing reads, as Orbax does; returns what asyncio logged."""
    import asyncio
    import gc

    async def read():
        first, second = (asyncio.ensure_future(_Failing(message)) for _ in range(2))
        await asyncio.sleep(0)  # both finish, failing; only the first is awaited
        await first

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(ValueError):
            asyncio.run(read())
        gc.collect()
    return [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def test_the_noise_filter_drops_only_a_tensorstore_reads_unretrieved_failure(caplog):
    orbax_noise.install()
    ts_error = 'DATA_LOSS: Error reading [tensorstore_spec=\'{"driver":"zarr"}\']'
    assert _unretrieved_errors_logged(ts_error, caplog) == []
    caplog.clear()
    kept = _unretrieved_errors_logged("a failure of someone else's task", caplog)
    assert kept and all(m.startswith("Task exception was never retrieved") for m in kept)
