"""One trainer per model_dir: a lock file that names its holder.

``train`` takes ``<model_dir>/trainer.lock`` for the length of the call (process 0 only in a
many-process job; evaluators and other readers take nothing). The file holds JSON naming the
holder (``host``, ``pid``, start time); it is locked with ``flock`` while held and its mtime is
refreshed every ``HEARTBEAT_SECS`` by a daemon thread. A second trainer then fails at once
with ``ModelDirInUseError`` naming the directory and the holder.

When is a lock stale (taken over, with a log line naming the old holder)?

* Same host: when no process holds the ``flock`` (the kernel drops it when its process dies,
  however it died), or the named pid is not running. A child process shares its parent's
  open files, hence the ``flock``: a forked child (an input worker) closes its copy at once
  (``os.register_at_fork``), and a lock whose ``flock`` is still held while the pid it names
  is gone (a child that did not run Python's fork hooks, or one given the descriptor) is
  taken over by replacing the file: the orphan keeps a lock on a file no one opens any more.
  Takeovers are serialised by a ``flock`` on the model_dir itself, so two restarts at the
  same moment cannot both win.
* A lock file whose content names no holder (bytes that are not the JSON this module writes)
  is taken over at once when its ``flock`` is free.
* Another host: when its heartbeat is older than ``STALE_SECS`` (the holder's machine died or
  lost the file system). A network file system that honours ``flock`` across hosts makes the
  lock exact there too; one that does not is covered by the heartbeat.

On return (or an error, or ``Preempted``) the lock is released: the file stays, empty.

Example:
  >>> lock = TrainerLock("/tmp/run")
  >>> lock.acquire()  # raises ModelDirInUseError while another trainer holds it
  >>> try:
  ...     ...  # train
  ... finally:
  ...     lock.release()
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
import weakref
from typing import Any

from ..core.errors import EstimatorRuntimeError

log = logging.getLogger("estimator")

LOCK_NAME = "trainer.lock"
HEARTBEAT_SECS = 10.0
STALE_SECS = 60.0
# How long a second trainer waits for a holder that has its flock but has not written its
# name yet (it writes right after flocking): long enough for a loaded machine, short enough
# to still fail "at once".
NAME_WAIT_SECS = 2.0


class ModelDirInUseError(EstimatorRuntimeError):
    """Another trainer holds the model_dir (its host and pid are named)."""


# The locks this process holds: a forked child closes its copies (see the module docstring).
_HELD: weakref.WeakSet[TrainerLock] = weakref.WeakSet()


def _close_in_child() -> None:
    for lock in list(_HELD):
        # Close, never LOCK_UN: unlocking a shared open file would free the parent's lock.
        with contextlib.suppress(OSError):
            os.close(lock._fd)  # type: ignore[arg-type]
        lock._fd = None
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _named(holder: dict[str, Any]) -> bool:
    """Whether ``holder`` is a holder's record (this module's JSON), not empty or garbage."""
    return "host" in holder and "pid" in holder and "raw" not in holder


def _describe(holder: dict[str, Any]) -> str:
    if not _named(holder):
        return (
            "a process whose lock file names no holder: a trainer starting this instant, or a "
            "process that inherited the lock's open file"
        )
    since = holder.get("since")
    when = f", since {since}" if since else ""
    return f"host {holder['host']}, pid {holder['pid']}{when}"


def _orphaned(holder: dict[str, Any]) -> bool:
    """Whether a flock held for ``holder`` outlived it (same host, its pid gone)."""
    pid = holder.get("pid")
    return (
        _named(holder)
        and holder.get("host") == socket.gethostname()
        and isinstance(pid, int)
        and not _pid_running(pid)
    )


def _open_regular(path: str) -> int:
    """Opens (or creates) the lock file, refusing anything but a regular file of one name: a
    symlink is never followed (a link planted in a shared model_dir would make the trainer
    truncate its target), a FIFO never blocks the open, and a hard link is never written
    through (the same harm by another route where ``fs.protected_hardlinks`` is off).

    Raises:
      ModelDirInUseError: ``path`` is a symlink, a directory, a FIFO or another special file,
        or a hard link.
    """
    with contextlib.suppress(FileNotFoundError):
        # Special files are refused before any open: opening a device can act on it.
        found = os.lstat(path).st_mode
        if not stat.S_ISREG(found):
            raise _not_a_file(path, _kind(found))
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except IsADirectoryError:
        raise _not_a_file(path, "a directory") from None
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link (planted since lstat)
            raise _not_a_file(path, "a symbolic link") from None
        if e.errno == errno.ENXIO:  # a FIFO with no reader
            raise _not_a_file(path, "a FIFO") from None
        raise
    st = os.fstat(fd)  # what was opened, whatever lstat saw
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        if stat.S_ISREG(st.st_mode):
            raise _not_a_file(path, f"a hard link (a file with {st.st_nlink} names)")
        raise _not_a_file(path, _kind(st.st_mode))
    return fd


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    return "not a regular file"


def _not_a_file(path: str, what: str) -> ModelDirInUseError:
    return ModelDirInUseError(
        f"{path} is {what}, where the trainer's lock file goes: remove it (the trainer opens "
        "only a regular file there, and never follows a link or writes through it; no "
        "trainer can start while it is there)."
    )


class TrainerLock:
    """The lock file of one model_dir (see the module docstring).

    Args:
      model_dir: the estimator's directory (created if missing).
    """

    def __init__(self, model_dir: str):
        self.model_dir = os.path.abspath(model_dir)
        self.path = os.path.join(self.model_dir, LOCK_NAME)
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def _read(self, fd: int) -> dict[str, Any]:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 4096).decode("utf-8", "replace").strip()
        if not text:
            return {}
        try:
            holder = json.loads(text)
        except ValueError:
            return {"raw": text[:100]}
        return holder if isinstance(holder, dict) else {"raw": text[:100]}

    def _held_elsewhere(self, fd: int, holder: dict[str, Any], flocked: bool) -> bool:
        """Whether ``holder`` (read from a file whose flock we hold, if ``flocked``) is live."""
        if not _named(holder):
            return False  # empty, released, or garbage: no one to wait for
        age = time.time() - os.fstat(fd).st_mtime
        if holder.get("host") == socket.gethostname():
            pid = holder.get("pid")
            if flocked or not isinstance(pid, int):  # its flock died with it
                return False
            return _pid_running(pid) and pid != os.getpid()
        return age < STALE_SECS  # another host: only its heartbeat can say

    def _open(self) -> int:
        if os.path.exists(self.model_dir) and not os.path.isdir(self.model_dir):
            raise NotADirectoryError(errno.ENOTDIR, "model_dir is not a directory", self.model_dir)
        os.makedirs(self.model_dir, exist_ok=True)
        return _open_regular(self.path)

    def _flock(self, fd: int) -> bool | None:
        """Tries the flock: True if taken, False if held, None if the file system has none."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as e:  # a file system without flock: the content decides
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            return None
        return True

    def _settled_holder(self, fd: int) -> tuple[bool, dict[str, Any]]:
        """Reads a flocked file's holder, waiting briefly for a trainer mid-acquire to write
        its name (or to release). Returns (whether we got the flock meanwhile, holder)."""
        deadline = time.monotonic() + NAME_WAIT_SECS
        while True:
            holder = self._read(fd)
            if _named(holder) or time.monotonic() > deadline:
                return False, holder
            time.sleep(0.05)
            if self._flock(fd):
                return True, self._read(fd)

    def acquire(self) -> None:
        """Takes the lock.

        Raises:
          ModelDirInUseError: a live trainer holds it (or the lock file's place is taken).
        """
        fd = self._open()
        try:
            got = self._flock(fd)
            if got is False:
                got, holder = self._settled_holder(fd)
                if not got:
                    if not _orphaned(holder):
                        raise self._in_use(holder)
                    os.close(fd)
                    fd = -1
                    fd = self._take_over_orphan(holder)
                    self._started(fd)
                    return
            holder = self._read(fd)
            if self._held_elsewhere(fd, holder, got is True):
                raise self._in_use(holder)
            if got and not self._same_file(fd):  # replaced by a takeover since we opened it
                os.close(fd)
                fd = -1
                self.acquire()
                return
            self._warn_taking_over(holder)
            os.ftruncate(fd, 0)
            os.pwrite(fd, self._mine(), 0)  # other processes read it now; fsync'd by _heartbeat
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        self._started(fd)

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _mine(self) -> bytes:
        return json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
        ).encode()

    def _warn_taking_over(self, holder: dict[str, Any]) -> None:
        if _named(holder):
            log.warning(
                "Taking over the lock of a trainer that is no longer running (%s): %s",
                _describe(holder),
                self.path,
            )
        elif holder:
            log.warning(
                "Taking over a lock file that names no holder (its content is not a trainer's "
                "name, and no process holds its flock): %s",
                self.path,
            )

    def _take_over_orphan(self, holder: dict[str, Any]) -> int:
        """Replaces the lock file whose flock outlived ``holder``; returns the new file's fd.

        Under a flock of the model_dir itself, so that two restarts cannot both replace it;
        the new file is flocked and named before it is renamed into place, so no one ever
        sees it free.
        """
        guard = os.open(self.model_dir, os.O_RDONLY)
        try:
            with contextlib.suppress(OSError):  # a file system without flock: no guard
                fcntl.flock(guard, fcntl.LOCK_EX)
            fd = _open_regular(self.path)
            try:
                got = self._flock(fd)
                now = self._read(fd) if got is False else {}
                if got is False and _named(now) and not _orphaned(now):
                    raise self._in_use(now)  # another restart took it over first
            finally:
                os.close(fd)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # a link planted there is removed, never followed
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.pwrite(fd, self._mine(), 0)
                os.fsync(fd)
                os.replace(tmp, self.path)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        finally:
            os.close(guard)  # drops the guard's flock
        self._warn_taking_over(holder)
        return fd

    def _started(self, fd: int) -> None:
        self._fd = fd
        _HELD.add(self)
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="trainer-lock", daemon=True)
        self._beat.start()

    def _in_use(self, holder: dict[str, Any]) -> ModelDirInUseError:
        return ModelDirInUseError(
            f"model_dir {self.model_dir} is in use by another trainer ({_describe(holder)}); "
            f"two trainers would overwrite each other's checkpoints. Stop that process, or "
            f"use another model_dir. (Lock file: {self.path}; a lock of a process that is "
            f"gone is taken over: at once on the same host, after {STALE_SECS:.0f} s without "
            "its heartbeat from another host.)"
        )

    def _heartbeat(self) -> None:
        # The holder's name reaches the disk (and a network file system's other hosts) here,
        # off the train call's path: one fsync can wait for the file system's other writes
        # (0.5 s seen after a cold job filled the compilation cache).
        with contextlib.suppress(OSError):
            os.fsync(self._fd)
        while not self._stop.wait(HEARTBEAT_SECS):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Empties the file and drops the flock (idempotent)."""
        if self._fd is None:
            return
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        _HELD.discard(self)
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            # Explicitly: a child that inherited the open file without running the fork hook
            # would otherwise keep the lock after this close.
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
