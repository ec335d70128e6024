"""The trainer lock against real processes (issue 30, items 1 and 6).

Each test reproduces a failure as an outside probe found it: a child process that outlives a
SIGKILLed trainer and keeps the lock; a lock file of bytes that are not JSON; a directory
where the lock file goes; a second trainer that starts in the instant between the first one's
``flock`` and its writing its name.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import estimator
from estimator.io import lock as lock_lib

ROOT = Path(__file__).resolve().parents[3]

# A trainer stand-in: takes the lock, starts a child that shares the lock's open file, says
# "ready" and sleeps. ``fork``: a Python os.fork child (an input worker); ``exec``: a program
# given the descriptor (what a C library's fork, or subprocess with pass_fds, leaves).
_HOLDER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from estimator.io import lock as lock_lib
    lock = lock_lib.TrainerLock(sys.argv[1])
    lock.acquire()
    if sys.argv[2] == "fork":
        child = os.fork()
        if child == 0:
            time.sleep(600)
            os._exit(0)
    else:
        child = subprocess.Popen(["sleep", "600"], pass_fds=[lock._fd]).pid
    print(child, flush=True)
    time.sleep(600)
    """
)


def _holder(model_dir: Path, how: str) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(model_dir), how],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    child = int(proc.stdout.readline())
    return proc, child


@pytest.mark.parametrize("how", ["fork", "exec"])
def test_a_child_that_outlives_a_killed_trainer_does_not_keep_the_lock(tmp_path, how, caplog):
    proc, child = _holder(tmp_path, how)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        os.kill(child, 0)  # the child still runs, holding what it inherited
        lock = lock_lib.TrainerLock(str(tmp_path))
        with caplog.at_level(logging.WARNING, logger="estimator"):
            lock.acquire()  # refused "in use by ... pid <dead>" before the fix
        assert f"pid {proc.pid}" in caplog.text and "no longer running" in caplog.text
        held = json.loads((tmp_path / lock_lib.LOCK_NAME).read_text())
        assert held["pid"] == os.getpid()
        # ... and the lock taken over is a real one: a third trainer is refused, naming us.
        with pytest.raises(estimator.ModelDirInUseError, match=f"pid {os.getpid()}"):
            _other_process_acquires(tmp_path)
        lock.release()
        _other_process_acquires(tmp_path)  # released: free again
    finally:
        proc.kill()
        os.kill(child, signal.SIGKILL)


def _other_process_acquires(model_dir: Path) -> None:
    """Acquires and releases the lock in a fresh process; re-raises its in-use error here."""
    code = (
        "import sys\nfrom estimator.io import lock as l\nk = l.TrainerLock(sys.argv[1])\n"
        "try:\n    k.acquire()\nexcept l.ModelDirInUseError as e:\n    print(e)\n"
        "    sys.exit(3)\nk.release()\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(model_dir)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=60,
    )
    if run.returncode == 3:
        raise estimator.ModelDirInUseError(run.stdout)
    assert run.returncode == 0, run.stderr


_RACER = textwrap.dedent(
    """
    import sys, time
    from estimator.io import lock as lock_lib
    lock = lock_lib.TrainerLock(sys.argv[1])
    while time.time() < float(sys.argv[2]):  # start together
        pass
    try:
        lock.acquire()
    except lock_lib.ModelDirInUseError:
        print("refused", flush=True)
    else:
        print("took", flush=True)
        time.sleep(2)
        lock.release()
    """
)


def test_two_restarts_at_the_same_moment_cannot_both_take_over_an_orphaned_lock(tmp_path):
    proc, child = _holder(tmp_path, "exec")
    try:
        proc.kill()
        proc.wait(timeout=30)
        start = time.time() + 3
        racers = [
            subprocess.Popen(
                [sys.executable, "-c", _RACER, str(tmp_path), str(start)],
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, PYTHONPATH=str(ROOT)),
            )
            for _ in range(3)
        ]
        said = sorted(r.communicate(timeout=60)[0].strip() for r in racers)
        assert said == ["refused", "refused", "took"]
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_live_trainers_forked_child_does_not_make_the_lock_look_free(tmp_path):
    proc, child = _holder(tmp_path, "fork")
    try:
        with pytest.raises(estimator.ModelDirInUseError, match=f"pid {proc.pid}"):
            lock_lib.TrainerLock(str(tmp_path)).acquire()
    finally:
        proc.kill()
        os.kill(child, signal.SIGKILL)


def test_a_lock_file_of_bytes_that_are_not_json_is_taken_over_at_once(tmp_path, caplog):
    (tmp_path / lock_lib.LOCK_NAME).write_bytes(b"\x00\xff garbage {not json")
    lock = lock_lib.TrainerLock(str(tmp_path))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="estimator"):
        lock.acquire()  # was "in use by host ?, pid ?" for STALE_SECS (60 s)
    assert time.monotonic() - started < lock_lib.STALE_SECS / 2
    assert "names no holder" in caplog.text and str(tmp_path / lock_lib.LOCK_NAME) in caplog.text
    lock.release()


def test_a_directory_named_trainer_lock_is_a_clear_error(tmp_path):
    (tmp_path / lock_lib.LOCK_NAME).mkdir()
    with pytest.raises(estimator.ModelDirInUseError) as info:
        lock_lib.TrainerLock(str(tmp_path)).acquire()  # was a raw IsADirectoryError
    message = str(info.value)
    assert str(tmp_path / lock_lib.LOCK_NAME) in message and "is a directory" in message


def test_a_trainer_starting_at_the_same_moment_is_named_not_host_question_mark(tmp_path):
    """The window between the holder's flock and its writing its name: wait for the name."""
    path = tmp_path / lock_lib.LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # flocked, nothing written yet: a trainer mid-acquire
    me = {"host": socket.gethostname(), "pid": os.getppid(), "since": "now"}
    writer = threading.Timer(0.3, lambda: os.pwrite(fd, json.dumps(me).encode(), 0))
    writer.start()
    try:
        with pytest.raises(estimator.ModelDirInUseError) as info:
            lock_lib.TrainerLock(str(tmp_path)).acquire()
        assert f"host {socket.gethostname()}, pid {os.getppid()}" in str(info.value)
        assert "?" not in str(info.value).split("(Lock file")[0]
    finally:
        writer.join()
        os.close(fd)


def test_a_holder_that_never_writes_its_name_is_described_not_question_marks(tmp_path):
    fd = os.open(tmp_path / lock_lib.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(estimator.ModelDirInUseError) as info:
            lock_lib.TrainerLock(str(tmp_path)).acquire()
        message = str(info.value)
        assert "host ?" not in message and "names no holder" in message
    finally:
        os.close(fd)


@pytest.mark.parametrize("target_exists", [True, False])
def test_a_planted_symlink_is_never_followed(tmp_path, target_exists):
    """Issue: ``ln -s ~/precious <model_dir>/trainer.lock`` made the next trainer empty it."""
    model_dir, precious = tmp_path / "run", tmp_path / "precious"
    model_dir.mkdir()
    if target_exists:
        precious.write_bytes(b"years of work")
    (model_dir / lock_lib.LOCK_NAME).symlink_to(precious)
    with pytest.raises(lock_lib.ModelDirInUseError, match="a symbolic link.*remove it"):
        lock_lib.TrainerLock(str(model_dir)).acquire()
    if target_exists:
        assert precious.read_bytes() == b"years of work"
    else:
        assert not precious.exists()  # not created through the link either
    assert (model_dir / lock_lib.LOCK_NAME).is_symlink()


def test_a_symlinked_lock_stops_train_before_anything_is_written(tmp_path):
    from tests import helpers

    model_dir, precious = tmp_path / "run", tmp_path / "precious"
    model_dir.mkdir()
    precious.write_bytes(b"keep")
    (model_dir / lock_lib.LOCK_NAME).symlink_to(precious)
    est = helpers.make_estimator(model_dir)
    x, y = helpers.make_data()
    with pytest.raises(lock_lib.ModelDirInUseError, match="symbolic link"):
        est.train(helpers.train_input_fn(x, y), max_steps=4)
    assert precious.read_bytes() == b"keep"
    assert sorted(p.name for p in model_dir.iterdir()) == [lock_lib.LOCK_NAME]


def test_a_fifo_in_the_locks_place_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / lock_lib.LOCK_NAME)
    with pytest.raises(lock_lib.ModelDirInUseError, match="FIFO"):
        lock_lib.TrainerLock(str(tmp_path)).acquire()


def test_a_planted_hard_link_is_never_written_through(tmp_path):
    """The symlink's harm by another route (where ``fs.protected_hardlinks`` is off, or the
    link is to one's own file): a regular file with a second name elsewhere."""
    model_dir, precious = tmp_path / "run", tmp_path / "precious"
    model_dir.mkdir()
    precious.write_bytes(b"years of work")
    os.link(precious, model_dir / lock_lib.LOCK_NAME)
    with pytest.raises(lock_lib.ModelDirInUseError, match="a hard link.*2 names.*remove it"):
        lock_lib.TrainerLock(str(model_dir)).acquire()
    assert precious.read_bytes() == b"years of work"
    assert (model_dir / lock_lib.LOCK_NAME).stat().st_nlink == 2


def test_a_symlink_planted_after_the_check_is_still_not_followed(tmp_path, monkeypatch):
    """``lstat`` then ``open`` leaves an instant between them: ``O_NOFOLLOW`` covers it."""
    precious = tmp_path / "precious"
    precious.write_bytes(b"keep")
    lock = lock_lib.TrainerLock(str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    real_lstat = os.lstat

    def lstat_then_plant(path, *args, **kwargs):
        if os.fspath(path) == lock.path:
            os.symlink(precious, lock.path)
            raise FileNotFoundError(path)  # what lstat saw an instant before the link
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(lock_lib.os, "lstat", lstat_then_plant)
    with pytest.raises(lock_lib.ModelDirInUseError, match="a symbolic link"):
        lock.acquire()
    assert precious.read_bytes() == b"keep"
