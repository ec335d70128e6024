"""Where a ``train`` call ends: one step budget that the input schedule and the loop both read.

``max_steps``, ``steps`` and the hooks' ``planned_last_step`` become one target step. The
input side asks ``next_loop()`` for each loop's steps as it stages them (the final loop is cut
to land on the target exactly); the step loop asks ``reached(step)`` after each loop and stops
there. Why training ended is one ``EndReason``, logged in one line (``log_end``).

Example:
  >>> budget = StepBudget.of(10, steps=None, max_steps=15, hook_targets=(), iterations_per_loop=4)
  >>> [budget.next_loop() for _ in range(3)], budget.reached(14), budget.reached(15)
  ([4, 1, 0], False, True)
  >>> budget.why
  'max_steps=15'
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from .job import EndReason, TrainOutcome

log = logging.getLogger("estimator")


class StepBudget:
    """The steps one ``train`` call may run, from ``start`` to ``target``.

    Args:
      start: the global step the call starts (is restored) at.
      target: the step to stop at; None trains until the input ends.
      iterations_per_loop: the steps of every loop but the final one.
      source: what set the target: ``"max_steps"``, ``"steps"`` or ``"hook"``.
    """

    def __init__(
        self, start: int, target: int | None, *, iterations_per_loop: int, source: str = ""
    ):
        self.start, self.target, self.source = start, target, source
        self._ipl = iterations_per_loop
        self._planned = start  # the steps handed to the input schedule so far

    @classmethod
    def of(
        cls,
        start: int,
        *,
        steps: int | None,
        max_steps: int | None,
        hook_targets: Iterable[int],
        iterations_per_loop: int,
    ) -> StepBudget:
        """The budget of a call starting at ``start``: the nearest of ``max_steps``,
        ``start + steps`` and the hooks' planned last steps (the first named wins a tie)."""
        targets = [("max_steps", max_steps), ("steps", None if steps is None else start + steps)]
        targets += [("hook", int(t)) for t in hook_targets]
        given = [(t, source) for source, t in targets if t is not None]
        if not given:
            return cls(start, None, iterations_per_loop=iterations_per_loop)
        target, source = min(given, key=lambda g: g[0])
        return cls(start, target, iterations_per_loop=iterations_per_loop, source=source)

    @property
    def why(self) -> str:
        """The target as the user set it (``max_steps=500``), for log lines."""
        if self.source == "steps":
            return f"steps={self.target - self.start}"
        if self.source == "hook":
            return f"a hook's planned last step {self.target}"
        return f"{self.source}={self.target}" if self.target is not None else "no target"

    def next_loop(self) -> int:
        """The steps of the next loop to stage (<= 0: none left). Called on the input thread."""
        n = self._ipl if self.target is None else min(self._ipl, self.target - self._planned)
        self._planned += max(n, 0)
        return n

    def set_iterations_per_loop(self, n: int) -> None:
        """The steps of the loops staged from now on (``iterations_per_loop="auto"``)."""
        self._ipl = n

    def reached(self, step: int) -> bool:
        """Whether ``step`` is at (or past) the target."""
        return self.target is not None and step >= self.target


def planned_last_steps(hooks, start_step: int) -> list[int]:
    """Steps the hooks plan to stop at (``planned_last_step``), so the final loop lands on
    them exactly."""
    out = []
    for hook in hooks or ():
        planned = getattr(hook, "planned_last_step", None)
        step = planned(start_step) if callable(planned) else None
        if step is not None:
            out.append(int(step))
    return out


def log_end(outcome: TrainOutcome, budget: StepBudget, *, signal: str | None = None) -> None:
    """The one line that says why training ended (at INFO; WARNING when the input ended
    before the target). ``signal`` names the stop request (``"preempted"``)."""
    step, reason = outcome.step, outcome.reason
    if reason is EndReason.ALREADY_DONE:
        if budget.source == "max_steps":
            log.info(
                "Skipping training since max_steps has already saved (step %d; max_steps %d).",
                step,
                budget.target,
            )
        else:
            log.info("Skipping training since %s is already reached (step %d).", budget.why, step)
    elif reason is EndReason.INPUT_END:
        _log_input_end(step, budget)
    elif reason is EndReason.TARGET:
        log.info("Training stopped at global step %d: %s reached.", step, budget.why)
    elif reason is EndReason.SIGNAL:
        why = {"preempted": "SIGTERM", "interrupted": "Ctrl-C"}.get(
            signal, "a stop signal in another process"
        )
        log.info("Training stopped at global step %d: %s.", step, why)
    else:
        who = "a hook" if reason is EndReason.HOOK else "a saving listener"
        log.info("Training stopped at global step %d: %s requested a stop.", step, who)


def _log_input_end(step: int, budget: StepBudget) -> None:
    """Training ended because the input did: say where, and what was not reached."""
    target = budget.target
    if target is None:
        log.info("Input ended at global step %d.", step)
    elif budget.source == "max_steps":
        log.warning("Input ended at global step %d: max_steps = %d was not reached.", step, target)
    elif budget.source == "steps":
        log.warning(
            "Input ended at global step %d: steps = %d (to global step %d) was not reached.",
            step,
            target - budget.start,
            target,
        )
    else:
        log.warning("Input ended at global step %d, before the planned stop at %d.", step, target)
