"""Preemption: SIGTERM during ``train`` saves a checkpoint at the next loop boundary and exits.

Preemptible machines get SIGTERM some seconds before they are killed. While ``train`` runs, a
handler records the signal; the training loop finishes the device loop in flight, runs the
hooks' ``after_run``/``end``, writes a checkpoint of that step (waiting for it to be on disk)
and then raises ``Preempted``, a ``SystemExit`` with exit status 143 (128 + SIGTERM). Uncaught,
it ends the process quietly with that status, so a scheduler sees "terminated, restart me"
rather than success; the restarted job resumes exactly from the checkpoint. Catch
``Preempted`` to do something else.

The handler is installed only when ``train`` runs in the main thread (Python delivers signals
there) and the previous handler is restored when ``train`` returns or raises.

Example:
  >>> try:
  ...     est.train(input_fn, max_steps=100_000)
  ... except estimator.Preempted as e:
  ...     print("stopped at step", e.global_step)   # the checkpoint of that step is on disk
  ...     raise
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger("estimator")

EXIT_STATUS = 128 + signal.SIGTERM


class Preempted(SystemExit):
    """Training stopped on SIGTERM after checkpointing ``global_step``.

    Attributes:
      global_step: the step of the checkpoint written before stopping.
      checkpoint: its directory.
    """

    def __init__(self, global_step: int, checkpoint: str | None):
        super().__init__(EXIT_STATUS)
        self.global_step = global_step
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return (
            f"preempted (SIGTERM): checkpoint of step {self.global_step} saved to "
            f"{self.checkpoint}; exiting with status {EXIT_STATUS}"
        )


class PreemptionWatcher:
    """A context manager recording SIGTERM while it is active (main thread only).

    Example:
      >>> with PreemptionWatcher() as watcher:
      ...     while not watcher.requested:
      ...         run_one_loop()
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self._signals = signals
        self._previous: dict[int, object] = {}
        self.requested = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:
            log.warning(
                "Received signal %d: saving a checkpoint at the end of this loop, then stopping.",
                signum,
            )
        self.requested = True

    def __enter__(self) -> PreemptionWatcher:
        if threading.current_thread() is not threading.main_thread():
            log.debug("train() is not in the main thread: SIGTERM is not handled.")
            return self
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
