"""Silences the two kinds of noise Orbax leaves behind a failed read, and one warning of its
checkpoint manager.

Orbax reads a checkpoint's arrays and metadata with ``asyncio.run`` over many TensorStore
futures. When one fails (a damaged step, which the estimator then skips for an older one),
``asyncio.run`` closes its loop while the other futures are still running; as each finishes,
TensorStore's thread calls ``loop.call_soon_threadsafe`` on the closed loop, and Python prints
a ``RuntimeError: Event loop is closed`` traceback through ``sys.unraisablehook`` (six lines
each, several per damaged step) long after the step was reported in one warning.

The same race has a second face: the other futures of the read fail too (every array of a
damaged step is unreadable), nobody awaits them any more, and when their tasks are collected
asyncio logs ``ERROR:asyncio:Task exception was never retrieved`` with a seven-line traceback
per array. The first failure already reached the estimator, which named the step in its
warning; these are the same damage told again, at random (a race, about one run in eight).

Orbax's checkpoint manager also warns, through absl, whenever a save waited more than a
second for the previous one (``WARNING:absl:Waiting for previous save to complete took 1.01
seconds. If this number is high, consider checkpointing less frequently.``): the estimator
saves asynchronously and waits for a write to commit at its own points (the CLI printed it
on a first run); that record goes to DEBUG on the ``estimator`` logger instead.

``install()`` acts once per process. It wraps ``sys.unraisablehook`` to drop exactly the first
kind: a ``RuntimeError`` whose message is ``Event loop is closed`` raised in asyncio's
``call_soon_threadsafe``, with no object (TensorStore's callback). It adds a filter to the
``asyncio`` logger that drops exactly the second: a never-retrieved exception of the task
asyncio wraps around a non-coroutine awaitable (``_wrap_awaitable``, which ``ensure_future``
and ``gather`` make for TensorStore's futures) whose error is TensorStore's (its message
carries ``tensorstore_spec``). Everything else passes.

Example:
  >>> install()  # idempotent; Checkpoints calls it
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback
from typing import Any

log = logging.getLogger("estimator")

_installed = False
_lock = threading.Lock()
_dropped = 0


def is_closed_loop_noise(unraisable: Any) -> bool:
    """Whether an ``sys.unraisablehook`` argument is the closed-loop callback error."""
    error = unraisable.exc_value
    if not isinstance(error, RuntimeError) or str(error) != "Event loop is closed":
        return False
    if unraisable.object is not None:
        return False
    frames = traceback.extract_tb(unraisable.exc_traceback)
    return any(f.name == "call_soon_threadsafe" and "asyncio" in f.filename for f in frames)


def is_unretrieved_read_noise(record: logging.LogRecord) -> bool:
    """Whether an ``asyncio`` log record is a TensorStore read's never-retrieved failure."""
    message = record.getMessage()
    if not message.startswith("Task exception was never retrieved") or not record.exc_info:
        return False
    error = record.exc_info[1]
    return (
        "coro=<_wrap_awaitable()" in message
        and isinstance(error, Exception)
        and "tensorstore_spec" in str(error)
    )


def _drop() -> None:
    """Counts one dropped report; the first is said at DEBUG."""
    global _dropped
    _dropped += 1
    if _dropped == 1:
        log.debug("Dropped Orbax's noise after a failed read (a closed loop or unread failures).")


class _UnretrievedReadFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if is_unretrieved_read_noise(record):
            _drop()
            return False
        return True


def is_save_wait_warning(record: logging.LogRecord) -> bool:
    """Whether an ``absl`` record is the checkpoint manager's wait-for-previous-save warning."""
    return isinstance(record.msg, str) and record.msg.startswith(
        "Waiting for previous save to complete took"
    )


class _SaveWaitFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if is_save_wait_warning(record):
            log.debug("Orbax: %s", record.getMessage())
            return False
        return True


def install() -> None:
    """Installs the three filters (once per process; later calls do nothing)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            if is_closed_loop_noise(unraisable):
                _drop()
                return
            previous(unraisable)

        sys.unraisablehook = hook
        logging.getLogger("asyncio").addFilter(_UnretrievedReadFilter())
        logging.getLogger("absl").addFilter(_SaveWaitFilter())
