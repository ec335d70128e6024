"""Stopping training on a signal: SIGTERM (preemption) and Ctrl-C (SIGINT).

Preemptible machines get SIGTERM some seconds (a grace period, often 30 s) before they are
killed. While ``train`` runs in the main thread, a handler records SIGTERM; wherever it lands
(the device loop, a hook, a wait for input, a wait for the host_call queue, the checkpoint
write at the end of the call), the loop stops at the next loop boundary without waiting for
more input, writes a checkpoint of the last finished step and waits until it is committed,
gives host_call work still queued a few seconds (``HOST_DRAIN_SECS``), and raises
``Preempted``: a ``SystemExit`` with exit status 143 (128 + SIGTERM). Uncaught, it ends the
process quietly with that status, so a scheduler sees "terminated, restart me" rather than
success; the restarted job resumes exactly from the checkpoint.

Ctrl-C works the same way: the first SIGINT finishes the loop in flight, saves, and raises
``KeyboardInterrupt("interrupted at step N, checkpoint saved; run again to resume")``; a
second SIGINT raises ``KeyboardInterrupt`` at once, without saving the loop in flight (a
checkpoint write already started is still waited for, so nothing half-written is left to a
background thread at exit).

The handlers are installed only when ``train`` runs in the main thread (Python delivers
signals there) and the previous handlers are restored when ``train`` returns or raises. A
signal is acted upon when the main thread next runs Python code: at the latest when the
device loop in flight returns.

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
HOST_DRAIN_SECS = 5.0  # after the stop checkpoint is committed, for host_call work queued


class Preempted(SystemExit):
    """Training stopped on SIGTERM after checkpointing ``global_step``.

    Attributes:
      global_step: the step of the checkpoint written before stopping.
      checkpoint: its directory (None when training stopped before it had any state).
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


_active: list[StopSignals] = []


def active() -> StopSignals | None:
    """The ``StopSignals`` of the ``train`` call running now (signals are process-wide)."""
    return _active[-1] if _active else None


class StopSignals:
    """A context manager recording SIGTERM and Ctrl-C while training runs (main thread only).

    Attributes:
      event: set on the first SIGTERM or SIGINT; waits for input or host work poll it.
      reason: ``"preempted"`` (SIGTERM, which wins) or ``"interrupted"`` (SIGINT), or None.

    Example:
      >>> with StopSignals() as signals:
      ...     while not signals.requested:
      ...         run_one_loop()
      ...     save()
      >>> if signals.requested:
      ...     raise signals.stop_error(step, checkpoint)
    """

    def __init__(self):
        self.event = threading.Event()
        self.reason: str | None = None
        self._sigints = 0
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """Whether a stop was requested (SIGTERM or a first Ctrl-C)."""
        return self.event.is_set()

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self.reason != "preempted":
            log.warning(
                "Received SIGTERM: saving a checkpoint at the end of this loop, then stopping."
            )
        self.reason = "preempted"
        self.event.set()

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self._sigints += 1
        if self._sigints == 1:
            log.warning(
                "Interrupted (Ctrl-C): finishing this loop and saving a checkpoint; "
                "press Ctrl-C again to stop at once without saving it."
            )
            self.reason = self.reason or "interrupted"
            self.event.set()
            return
        self._restore(signal.SIGINT)  # a third Ctrl-C acts as it did before train()
        raise KeyboardInterrupt(
            "aborted by a second Ctrl-C; the loop in flight was not saved (run again to "
            "resume from the latest checkpoint)"
        )

    def stop_error(self, step: int, checkpoint: str | None) -> BaseException:
        """What ``train`` raises once the checkpoint of ``step`` is committed."""
        if self.reason == "preempted":
            return Preempted(step, checkpoint)
        return KeyboardInterrupt(
            f"interrupted at step {step}, checkpoint saved; run again to resume"
        )

    def _restore(self, sig: int) -> None:
        if sig in self._previous:
            previous = self._previous.pop(sig)  # None: a handler not set from Python
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)

    def __enter__(self) -> StopSignals:
        _active.append(self)
        if threading.current_thread() is not threading.main_thread():
            log.debug("train() is not in the main thread: SIGTERM and SIGINT are not handled.")
            return self
        self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        for sig in list(self._previous):
            self._restore(sig)
        _active.remove(self)
