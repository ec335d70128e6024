"""``SecondOrStepTimer``: "every N seconds or every N steps", as in ``tf.train``.

Example:
  >>> timer = SecondOrStepTimer(every_steps=10)
  >>> timer.should_trigger_for_step(1)  # the first call always triggers
  True
  >>> timer.update_last_triggered_step(1)
  (None, None)
  >>> timer.should_trigger_for_step(10), timer.should_trigger_for_step(11)
  (False, True)
"""

from __future__ import annotations

import time
from collections.abc import Callable


class SecondOrStepTimer:
    """Triggers every ``every_secs`` seconds or every ``every_steps`` steps (exactly one).

    Args:
      every_secs: minimum seconds between triggers.
      every_steps: minimum global steps between triggers.
      clock: the time source (``time.monotonic``); tests inject a fake one.

    Raises:
      ValueError: unless exactly one of ``every_secs``/``every_steps`` is given, or if
        ``every_secs < 0`` or ``every_steps < 1`` (``every_secs=0`` triggers every time).
    """

    def __init__(
        self,
        every_secs: float | None = None,
        every_steps: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        if (every_secs is None) == (every_steps is None):
            raise ValueError(
                "Exactly one of every_secs and every_steps should be provided, got "
                f"every_secs={every_secs!r}, every_steps={every_steps!r}."
            )
        if (every_secs is not None and every_secs < 0) or (
            every_steps is not None and every_steps < 1
        ):
            raise ValueError(
                f"Timer interval must be every_secs >= 0 or every_steps >= 1, got "
                f"every_secs={every_secs!r}, every_steps={every_steps!r}."
            )
        self._every_secs = every_secs
        self._every_steps = every_steps
        self.clock = clock
        self.reset()

    @property
    def every_secs(self) -> float | None:
        return self._every_secs

    @property
    def every_steps(self) -> int | None:
        return self._every_steps

    def reset(self) -> None:
        """Forgets the last trigger, so the next ``should_trigger_for_step`` is True."""
        self._last_triggered_step: int | None = None
        self._last_triggered_time: float | None = None

    def should_trigger_for_step(self, step: int, now: float | None = None) -> bool:
        """Whether ``step`` (observed at time ``now``, default: the clock) is due."""
        if self._last_triggered_step is None:
            return True
        if step == self._last_triggered_step:
            return False
        if self._every_secs is not None:
            now = self.clock() if now is None else now
            return now >= self._last_triggered_time + self._every_secs
        return step >= self._last_triggered_step + self._every_steps

    def update_last_triggered_step(
        self, step: int, now: float | None = None
    ) -> tuple[float | None, int | None]:
        """Records a trigger at ``step``; returns (secs, steps) since the previous one."""
        now = self.clock() if now is None else now
        elapsed: tuple[float | None, int | None] = (None, None)
        if self._last_triggered_time is not None:
            elapsed = (now - self._last_triggered_time, step - self._last_triggered_step)
        self._last_triggered_time = now
        self._last_triggered_step = step
        return elapsed

    def last_triggered_step(self) -> int | None:
        """The step of the last trigger, ``None`` before the first one."""
        return self._last_triggered_step
