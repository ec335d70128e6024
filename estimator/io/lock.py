"""One trainer per model_dir: a lock file that names its holder.

``train`` takes ``<model_dir>/trainer.lock`` for the length of the call (process 0 only in a
many-process job; evaluators and other readers take nothing). The file holds JSON naming the
holder (``host``, ``pid``, start time); it is locked with ``flock`` while held and its mtime is
refreshed every ``HEARTBEAT_SECS`` by a daemon thread. A second trainer then fails at once
with ``ModelDirInUseError`` naming the directory and the holder.

When is a lock stale (taken over, with a log line naming the old holder)?

* Same host: when no process holds the ``flock`` (the kernel drops it when its process dies,
  however it died), or the named pid is not running.
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
import threading
import time
from typing import Any

from ..errors import EstimatorRuntimeError

log = logging.getLogger("estimator")

LOCK_NAME = "trainer.lock"
HEARTBEAT_SECS = 10.0
STALE_SECS = 60.0


class ModelDirInUseError(EstimatorRuntimeError):
    """Another trainer holds the model_dir (its host and pid are named)."""


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _describe(holder: dict[str, Any]) -> str:
    since = holder.get("since")
    when = f", since {since}" if since else ""
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}{when}"


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
            return {"host": "?", "pid": "?", "raw": text[:100]}
        return holder if isinstance(holder, dict) else {}

    def _held_elsewhere(self, fd: int, holder: dict[str, Any], flocked: bool) -> bool:
        """Whether ``holder`` (read from a file whose flock we hold, if ``flocked``) is live."""
        if not holder:
            return False
        age = time.time() - os.fstat(fd).st_mtime
        if holder.get("host") == socket.gethostname():
            pid = holder.get("pid")
            if flocked or not isinstance(pid, int):  # its flock died with it
                return False
            return _pid_running(pid) and pid != os.getpid()
        return age < STALE_SECS  # another host: only its heartbeat can say

    def acquire(self) -> None:
        """Takes the lock.

        Raises:
          ModelDirInUseError: a live trainer holds it.
        """
        if os.path.exists(self.model_dir) and not os.path.isdir(self.model_dir):
            raise NotADirectoryError(errno.ENOTDIR, "model_dir is not a directory", self.model_dir)
        os.makedirs(self.model_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            flocked = True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._read(fd)
                raise self._in_use(holder) from None
            except OSError as e:  # a file system without flock: the content decides
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                flocked = False
            holder = self._read(fd)
            if self._held_elsewhere(fd, holder, flocked):
                raise self._in_use(holder)
            if holder:
                log.warning(
                    "Taking over the lock of a trainer that is no longer running (%s): %s",
                    _describe(holder),
                    self.path,
                )
            mine = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(mine).encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
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
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            # Explicitly: a child forked meanwhile (a data loader's worker) shares the open
            # file and would otherwise keep the lock after this close.
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
