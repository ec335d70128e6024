"""A full disk while writing a checkpoint: one clear error naming the path, not Orbax's noise.

Orbax writes a checkpoint on background threads. When the disk fills up, TensorStore fails
with ``RESOURCE_EXHAUSTED`` (or Python with ``ENOSPC``), Orbax logs two absl ERROR records
with their tracebacks (about 90 lines), and the next wait raises the error without saying
which step was lost. Here that becomes one ``OSError(ENOSPC)`` whose message names the step
directory that could not be written and the newest step that is intact; Orbax's ERROR records
of such a failure are dropped (the error says it all). The unfinished write stays an
``*.orbax-checkpoint-tmp`` directory that is never read as a checkpoint and is removed by the
next trainer; every step saved before is untouched.

Example:
  >>> if is_disk_full(error):
  ...     raise disk_full_error(path, intact_step=10) from error
"""

from __future__ import annotations

import errno
import logging
import threading

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_WORDS = ("RESOURCE_EXHAUSTED", "No space left on device", "Disk quota exceeded")
_installed = False
_lock = threading.Lock()


def is_disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` (or an error it was raised from) says the disk is full."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
            return True
        text = str(error)
        if any(word in text for word in _FULL_WORDS):
            return True
        error = error.__cause__ or error.__context__
    return False


def disk_full_error(path: str, *, intact_step: int | None) -> OSError:
    """The error to raise: ENOSPC, naming ``path`` and the newest intact step."""
    intact = (
        f"the checkpoints saved before are intact (newest: step {intact_step})"
        if intact_step is not None
        else "no checkpoint was saved before this one"
    )
    return OSError(
        errno.ENOSPC,
        f"No space left on device: checkpoint {path} could not be written; {intact}. Free "
        "space (or lower keep_checkpoint_max) and run the same command again to resume",
        path,
    )


def model_dir_full_error(model_dir: str, what: str) -> OSError:
    """The error for a disk found full before training started: ENOSPC naming the
    model_dir and what could not be written there (``what``: "its lock file")."""
    return OSError(
        errno.ENOSPC,
        f"No space left on device: cannot write {what} in model_dir {model_dir}; nothing "
        "was trained or changed. Free space on that disk (or use a model_dir on another one) "
        "and run the same command again",
        model_dir,
    )


def export_full_error(base: str) -> OSError:
    """The error for an export that did not fit: ENOSPC naming the export directory.

    The half-written export was removed; the exports made before are untouched.
    """
    return OSError(
        errno.ENOSPC,
        f"No space left on device: the export into {base} could not be written; nothing "
        "partial was left there and earlier exports are intact. Free space on that disk (or "
        "export elsewhere) and export again: the checkpoint it reads is unchanged",
        base,
    )


def _keep(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (record.levelno >= logging.ERROR and is_disk_full(exc))


def drop_orbax_disk_full_records() -> None:
    """Drops Orbax's absl ERROR records whose exception is a full disk (once per process)."""
    global _installed
    with _lock:
        if not _installed:
            logging.getLogger("absl").addFilter(_keep)
            _installed = True
