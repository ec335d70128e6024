"""The GCS emulator the bucket tests stand on: every client the estimator uses reaches it.

gcsfs, etils.epath (through gcsfs), Orbax (through TensorStore), a child process that only
inherits the environment, TensorBoard's reader, and the generation preconditions the trainer
lease (``estimator/io/lease.py``) relies on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import gcs_emulator as emulator


def _fs():
    import gcsfs

    return gcsfs.GCSFileSystem()


def test_gcsfs_writes_and_lists(gcs_bucket):
    prefix = f"{gcs_bucket[5:]}/{uuid.uuid4().hex}"
    fs = _fs()
    fs.pipe(f"{prefix}/a/x.txt", b"hello")
    assert fs.ls(f"{prefix}/a") == [f"{prefix}/a/x.txt"]
    assert fs.cat(f"{prefix}/a/x.txt") == b"hello"


def test_epath_reads_writes_lists_and_removes_through_gcsfs(gcs_url):
    from etils import epath

    run = epath.Path(gcs_url)
    (run / "d").mkdir(parents=True, exist_ok=True)
    (run / "d" / "f.txt").write_text("hello")
    assert (run / "d" / "f.txt").read_text() == "hello"
    assert [p.name for p in run.iterdir()] == ["d"]
    assert [os.fspath(p) for p in run.glob("*/*.txt")] == [f"{gcs_url}/d/f.txt"]
    assert (run / "d").is_dir() and (run / "d" / "f.txt").exists()
    (run / "d").rmtree()
    assert not (run / "d" / "f.txt").exists()


def test_orbax_saves_rotates_and_restores_through_tensorstore(gcs_url):
    import orbax.checkpoint as ocp

    tree = {"w": jnp.arange(8.0), "b": {"c": jnp.ones((2, 3), jnp.int32)}}
    options = ocp.CheckpointManagerOptions(max_to_keep=1)
    with ocp.CheckpointManager(f"{gcs_url}/ckpt", options=options) as manager:
        for step in (1, 2):
            scaled = jax.tree.map(lambda a, k=step: a * k, tree)
            manager.save(step, args=ocp.args.StandardSave(scaled))
        manager.wait_until_finished()
        assert manager.all_steps() == [2]
        restored = manager.restore(2, args=ocp.args.StandardRestore(tree))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, 2 * np.asarray(b)), restored, tree)
    assert _fs().ls(f"{gcs_url[5:]}/ckpt") == [f"{gcs_url[5:]}/ckpt/2"]


def _upload(fs, path: str, data: bytes, generation: int) -> int:
    """A write conditional on ``generation`` (0: absent), as the lease makes it."""
    from estimator.io import lease

    return lease._Gcs(f"gs://{path}", fs=fs).write_bytes(data, generation=generation)


def test_the_emulator_honours_if_generation_match_on_writes(gcs_url):
    from estimator.io import lease

    fs, path = _fs(), f"{gcs_url[5:]}/obj"
    first = _upload(fs, path, b"1", 0)
    with pytest.raises(lease._Conflict):
        _upload(fs, path, b"2", 0)  # create-if-absent: it exists
    with pytest.raises(lease._Conflict):
        _upload(fs, path, b"2", first + 1)  # a generation it is not at
    assert _upload(fs, path, b"2", first) != first
    assert fs.cat(path) == b"2"


@pytest.mark.parametrize("existing", [False, True])
def test_of_racing_conditional_writers_exactly_one_wins(gcs_url, existing):
    fs, path = _fs(), f"{gcs_url[5:]}/obj"
    generation = _upload(fs, path, b"old", 0) if existing else 0
    writers = 8
    barrier, wins = threading.Barrier(writers), []

    def write(i: int) -> None:
        from estimator.io import lease

        barrier.wait()
        try:
            _upload(fs, path, str(i).encode(), generation)
            wins.append(i)
        except lease._Conflict:
            pass

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(wins) == 1 and fs.cat(path) == str(wins[0]).encode()


_CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["tensorflow"] = None  # TensorBoard's own reader: TF's GCS knows no emulator
    import gcsfs
    from etils import epath
    from tensorboard.backend.event_processing import event_accumulator

    url = sys.argv[1]
    epath.Path(url, "child.txt").write_text("from the child")
    print(gcsfs.GCSFileSystem().cat(url[5:] + "/child.txt").decode())
    events = event_accumulator.EventAccumulator(url + "/events")
    events.Reload()
    print([(e.step, e.value) for e in events.Scalars("loss")])
    """
)


def test_a_child_process_inherits_the_emulator_and_tensorboard_reads_events(gcs_url, tmp_path):
    from tensorboardX import SummaryWriter

    with SummaryWriter(str(tmp_path)) as writer:
        writer.add_scalar("loss", 1.5, 3)
    (event_file,) = tmp_path.iterdir()
    _fs().put(str(event_file), f"{gcs_url[5:]}/events/{event_file.name}")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, gcs_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["from the child", "[(3, 1.5)]"]
    assert out.stderr == ""  # no credential or bucket-layout warnings in a child either


def test_a_second_emulator_restores_the_first_ones_variables(gcs_emulator):
    before = {name: os.environ.get(name) for name in gcs_emulator.environment()}
    second = emulator.start()
    try:
        assert os.environ["STORAGE_EMULATOR_HOST"] == second.url != gcs_emulator.url
    finally:
        second.stop()
    assert {name: os.environ.get(name) for name in before} == before
