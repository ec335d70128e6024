"""The step budget of a ``train`` call (``driver/budget.py``): one target from ``max_steps``,
``steps`` and the hooks, the loops the input side stages to land on it, and the line that
says why training ended. Expected values are written out per row; the loops are checked
against a hand-written count (full loops of IPL, then the remainder).
"""

from __future__ import annotations

import doctest
import logging

import pytest

from estimator.data import plan
from estimator.driver import budget as budget_lib
from estimator.driver.budget import StepBudget, planned_last_steps
from estimator.driver.job import EndReason, TrainOutcome


def _loops_until_empty(b: StepBudget, limit: int = 100) -> list[int]:
    out = []
    for _ in range(limit):
        n = b.next_loop()
        if n <= 0:
            return out
        out.append(n)
    return out


def _expected_loops(start: int, target: int, ipl: int) -> list[int]:
    """Whole loops of ``ipl``, then what is left to reach ``target``."""
    left = max(target - start, 0)
    return [ipl] * (left // ipl) + ([left % ipl] if left % ipl else [])


# start, steps, max_steps, hook targets, ipl -> target, source, why
BUDGETS = [
    (0, None, 10, (), 4, 10, "max_steps", "max_steps=10"),
    (10, None, 15, (), 4, 15, "max_steps", "max_steps=15"),
    (10, 7, None, (), 4, 17, "steps", "steps=7"),
    (10, 7, 15, (), 4, 15, "max_steps", "max_steps=15"),  # the nearest wins
    (10, 3, 15, (), 4, 13, "steps", "steps=3"),
    (10, 3, None, (), 4, 13, "steps", "steps=3"),
    (10, 5, 15, (), 4, 15, "max_steps", "max_steps=15"),  # a tie: the first named wins
    (10, None, 30, (12, 20), 4, 12, "hook", "a hook's planned last step 12"),
    (10, None, 20, (12,), 4, 12, "hook", "a hook's planned last step 12"),
    (10, None, 12, (12,), 4, 12, "max_steps", "max_steps=12"),  # a tie with a hook
    (10, 2, None, (12,), 4, 12, "steps", "steps=2"),  # a tie with a hook: steps first
    (0, None, None, (5,), 2, 5, "hook", "a hook's planned last step 5"),
    (0, 8, None, (), 8, 8, "steps", "steps=8"),  # exactly one loop
    (0, 1, None, (), 100, 1, "steps", "steps=1"),
]


@pytest.mark.parametrize(
    "start, steps, max_steps, hooks, ipl, target, source, why",
    BUDGETS,
    ids=[f"start{r[0]}-steps{r[1]}-max{r[2]}-hooks{list(r[3])}-ipl{r[4]}" for r in BUDGETS],
)
def test_one_target_from_max_steps_steps_and_hooks(
    start, steps, max_steps, hooks, ipl, target, source, why
):
    b = StepBudget.of(
        start, steps=steps, max_steps=max_steps, hook_targets=hooks, iterations_per_loop=ipl
    )
    assert (b.start, b.target, b.source, b.why) == (start, target, source, why)
    assert _loops_until_empty(b) == _expected_loops(start, target, ipl)
    assert b.next_loop() <= 0  # stays empty once planned to the target
    assert not b.reached(target - 1) and b.reached(target) and b.reached(target + 5)


@pytest.mark.parametrize("start, max_steps", [(15, 15), (20, 15)])
def test_a_target_already_reached_plans_no_loop(start, max_steps):
    b = StepBudget.of(
        start, steps=None, max_steps=max_steps, hook_targets=(), iterations_per_loop=4
    )
    assert b.reached(start)
    assert b.next_loop() <= 0 and b.next_loop() <= 0


def test_without_a_target_loops_run_until_the_input_ends():
    b = StepBudget.of(7, steps=None, max_steps=None, hook_targets=(), iterations_per_loop=3)
    assert b.target is None and b.why == "no target"
    assert [b.next_loop() for _ in range(5)] == [3] * 5
    assert not b.reached(10**9)


def test_the_input_schedule_lands_on_the_target_exactly():
    """The budget feeds ``plan.plan_calls``: the calls' steps add up to the target and
    each loop ends where the budget cut it."""
    b = StepBudget.of(10, steps=None, max_steps=25, hook_targets=(), iterations_per_loop=4)
    calls = list(plan.plan_calls(b.next_loop, k=3, exact_tail=True))
    assert [c.steps for c in calls] == [3, 1, 3, 1, 3, 1, 3]
    ends, step = [], 10
    for c in calls:
        step += c.steps
        if c.ends_loop:
            ends.append(step)
    assert ends == [14, 18, 22, 25]
    assert [b.reached(s) for s in ends] == [False, False, False, True]


class _Hook:
    def __init__(self, last):
        self.last = last

    def planned_last_step(self, start):
        return self.last(start)


@pytest.mark.parametrize(
    "hooks, start, expected",
    [
        (None, 0, []),
        ([object()], 0, []),  # a hook without the method plans nothing
        ([_Hook(lambda s: s + 5)], 10, [15]),
        ([_Hook(lambda s: None), _Hook(lambda s: 7.0)], 0, [7]),  # None: no plan; ints
        ([_Hook(lambda s: 3), _Hook(lambda s: 9)], 0, [3, 9]),
    ],
)
def test_planned_last_steps_of_hooks(hooks, start, expected):
    got = planned_last_steps(hooks, start)
    assert got == expected and all(type(s) is int for s in got)


@pytest.mark.parametrize(
    "reason, steps, max_steps, signal, level, message",
    [
        (EndReason.TARGET, None, 20, None, "INFO", "global step 20: max_steps=20 reached"),
        (EndReason.TARGET, 5, None, None, "INFO", "global step 20: steps=5 reached"),
        (EndReason.ALREADY_DONE, None, 20, None, "INFO", "max_steps has already saved"),
        (EndReason.ALREADY_DONE, 0, None, None, "INFO", "steps=0 is already reached"),
        (EndReason.INPUT_END, None, 30, None, "WARNING", "max_steps = 30 was not reached"),
        (EndReason.INPUT_END, 15, None, None, "WARNING", "steps = 15 (to global step 30)"),
        (EndReason.INPUT_END, None, None, None, "INFO", "Input ended at global step 20."),
        (EndReason.SIGNAL, None, 30, "preempted", "INFO", "global step 20: SIGTERM."),
        (EndReason.SIGNAL, None, 30, "interrupted", "INFO", "global step 20: Ctrl-C."),
        (EndReason.SIGNAL, None, 30, None, "INFO", "a stop signal in another process"),
        (EndReason.HOOK, None, 30, None, "INFO", "a hook requested a stop"),
        (EndReason.LISTENER, None, 30, None, "INFO", "a saving listener requested a stop"),
    ],
)
def test_log_end_says_why_in_one_line(reason, steps, max_steps, signal, level, message, caplog):
    b = StepBudget.of(15, steps=steps, max_steps=max_steps, hook_targets=(), iterations_per_loop=4)
    with caplog.at_level(logging.INFO, logger="estimator"):
        budget_lib.log_end(TrainOutcome(20, reason), b, signal=signal)
    assert len(caplog.records) == 1
    assert caplog.records[0].levelname == level
    assert message in caplog.records[0].getMessage()


def test_docstring_examples():
    assert doctest.testmod(budget_lib).failed == 0
