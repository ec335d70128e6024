"""Long-lived background threads, reused from one call to the next.

Starting a thread per ``evaluate`` or ``train`` call costs more than its start: large numpy
buffers built on a short-lived thread land in that thread's malloc arena above the dynamic
mmap threshold and are never returned to the OS, so the process grows tens of MiB per call
while its live arrays stay flat. Work here runs on pooled daemon threads instead: a thread
that finished its task waits for the next one, and a new thread starts only when every
pooled thread is busy (so two pipelines open at once never wait on each other).

Example:
  >>> done = run_in_thread(lambda: None, name="example")
  >>> done.wait(5)
  True
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("estimator")

_lock = threading.Lock()
_idle: list[_Worker] = []


class _Worker:
    def __init__(self):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="estimator-worker", daemon=True)
        self._thread.start()

    def give(self, fn: Callable[[], None], done: threading.Event, name: str) -> None:
        self._tasks.put((fn, done, name))

    def _loop(self) -> None:
        while True:
            fn, done, name = self._tasks.get()
            self._thread.name = name
            try:
                fn()
            except BaseException:  # noqa: BLE001 - tasks report their own errors; keep the thread
                log.exception("Uncaught error in background task %s", name)
            finally:
                self._thread.name = "estimator-worker"
                with _lock:
                    _idle.append(self)
                done.set()


def run_in_thread(fn: Callable[[], None], *, name: str) -> threading.Event:
    """Runs ``fn()`` on a pooled background thread; the returned event is set when it ends."""
    done = threading.Event()
    with _lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        worker = _Worker()
    worker.give(fn, done, name)
    return done
