"""The ``temp-<timestamp>`` folders an export writes into, and removing those of dead exports.

An export writes ``<base>/temp-<ts>/`` and renames it to ``<base>/<ts>/`` when complete. While
it writes, it holds a ``flock`` on ``temp-<ts>/.exporting``. A killed export leaves its temp
folder behind; the next export into the same base removes every temp folder whose
``.exporting`` is no longer locked (its writer is gone, however it died), with one log line
each. A temp folder without ``.exporting`` (left by a version before this, or by an export
killed in the instant between creating the folder and its lock) is removed once it is older
than ``STALE_SECS``; a temp folder whose lock is held (an export still running, in this or
another process) is never touched.

Example:
  >>> temp, final, fd = reserve("/tmp/export")  # writes into temp, then:
  >>> finish(temp, final, fd)
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time

log = logging.getLogger("estimator")

EXPORTING_FILE = ".exporting"
TEMP_PREFIX = "temp-"
STALE_SECS = 600.0


def _dead(temp: str) -> bool:
    """Whether no export is writing ``temp`` any more (see the module docstring)."""
    marker = os.path.join(temp, EXPORTING_FILE)
    try:
        fd = os.open(marker, os.O_RDONLY)
    except FileNotFoundError:
        try:
            return time.time() - os.stat(temp).st_mtime > STALE_SECS
        except FileNotFoundError:
            return False  # renamed into place meanwhile
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # locked: its writer runs (or flock is unsupported: keep it)
    finally:
        os.close(fd)
    return True


def sweep(base: str) -> list[str]:
    """Removes the temp folders of exports that died; returns their paths."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        names = sorted(os.listdir(base))
    for name in names if os.path.isdir(base) else ():
        temp = os.path.join(base, name)
        if not name.startswith(TEMP_PREFIX) or not os.path.isdir(temp) or not _dead(temp):
            continue
        shutil.rmtree(temp, ignore_errors=True)
        if not os.path.exists(temp):
            log.info("Removed %s, left by an export that did not finish.", temp)
            removed.append(temp)
    return removed


def reserve(base: str) -> tuple[str, str, int]:
    """A fresh, locked ``temp-<ts>`` folder, the ``<ts>`` path it becomes, and the lock's fd.

    Folders left by dead exports are removed first (``sweep``).
    """
    os.makedirs(base, exist_ok=True)
    sweep(base)
    ts = int(time.time())
    while True:
        final, temp = os.path.join(base, str(ts)), os.path.join(base, f"{TEMP_PREFIX}{ts}")
        if not os.path.exists(final):
            try:
                os.makedirs(temp)
            except FileExistsError:
                ts += 1
                continue
            fd = os.open(os.path.join(temp, EXPORTING_FILE), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            return temp, final, fd
        ts += 1


def unlock(temp: str, fd: int) -> None:
    """Removes the lock file from ``temp`` (before its rename) and closes it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(temp, EXPORTING_FILE))
    os.close(fd)
