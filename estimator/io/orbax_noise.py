"""Silences one kind of noise Orbax leaves behind a failed read: ``Event loop is closed``.

Orbax reads a checkpoint's arrays and metadata with ``asyncio.run`` over many TensorStore
futures. When one fails (a damaged step, which the estimator then skips for an older one),
``asyncio.run`` closes its loop while the other futures are still running; as each finishes,
TensorStore's thread calls ``loop.call_soon_threadsafe`` on the closed loop, and Python prints
a ``RuntimeError: Event loop is closed`` traceback through ``sys.unraisablehook`` (six lines
each, several per damaged step) long after the step was reported in one warning.

``install()`` wraps ``sys.unraisablehook`` once per process to drop exactly those: a
``RuntimeError`` whose message is ``Event loop is closed`` raised in asyncio's
``call_soon_threadsafe``, with no object (TensorStore's callback). Everything else goes to the
hook that was there before.

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


def install() -> None:
    """Installs the filter (once per process; later calls do nothing)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            global _dropped
            if is_closed_loop_noise(unraisable):
                _dropped += 1
                if _dropped == 1:
                    log.debug("Dropped Orbax's 'Event loop is closed' noise after a failed read.")
                return
            previous(unraisable)

        sys.unraisablehook = hook
