"""The call planner (``data/plan.py``): how a loop's steps become compiled calls that fit the
staging budget.

Every expected plan in the tables is written out; the arithmetic each row follows is in its
comment (``fit = budget // step_bytes``; when the loop does not fit, ``c = ceil(ipl / fit)``
calls are needed and the largest divisor of IPL that fits is taken if it costs at most
``c // 4`` more calls, else ``ceil(ipl / c)``), and the invariants are checked on every row
against sums the test computes itself.
"""

from __future__ import annotations

import doctest
import math

import pytest

from estimator.core.errors import EstimatorValueError
from estimator.data import plan


def _runs(*runs: tuple[int, int]) -> list[int]:
    """``(length, count)`` runs written out: ``_runs((7, 2), (6, 1)) == [7, 7, 6]``."""
    return [length for length, count in runs for _ in range(count)]


# step_bytes, iterations_per_loop, budget -> k, a training loop's calls, an eval loop's calls
PLANS = [
    # the whole loop fits: one call of IPL steps
    (10, 7, 1000, 7, [7], [7]),
    (100, 10, 1000, 10, [10], [10]),
    # fit 9 < 10: c = 2, divisor 5 needs 2 calls (<= 2): two calls of 5
    (100, 10, 999, 5, [5, 5], [5, 5]),
    # fit 10, c = 3, divisor 5 needs 5 calls > 3: ceil(25 / 3) = 9; tail 7 (eval: 4 + 2 + 1)
    (100, 25, 1024, 9, [9, 9, 7], [9, 9, 4, 2, 1]),
    # fit 21, c = 48, divisor 20 needs 50 <= 48 + 12: 50 calls of 20, one program
    (100, 1000, 2100, 20, _runs((20, 50)), _runs((20, 50))),
    (1, 1000, 21, 20, _runs((20, 50)), _runs((20, 50))),
    # fit 300, c = 4, divisor 250 needs 4: four equal calls, not 300 * 3 + 100
    (1, 1000, 300, 250, _runs((250, 4)), _runs((250, 4))),
    # fit 7, c = 143, divisor 5 needs 200 > 178: ceil(1000 / 143) = 7, 142 x 7 + 6
    (1, 1000, 7, 7, _runs((7, 142), (6, 1)), _runs((7, 142), (4, 1), (2, 1))),
    # fit 5, c = 3, divisor 4 needs 3: three calls of 4
    (1, 12, 5, 4, [4, 4, 4], [4, 4, 4]),
    # fit 7, c = 2, divisor 6 needs 2: two calls of 6
    (1, 12, 7, 6, [6, 6], [6, 6]),
    # 13 is prime: fit 8, c = 2, divisor 1 needs 13 > 2: ceil(13 / 2) = 7
    (8, 13, 64, 7, [7, 6], [7, 4, 2]),
    # a budget below one step still runs one step per call
    (10**9, 50, 1, 1, _runs((1, 50)), _runs((1, 50))),
]


@pytest.mark.parametrize(
    "step_bytes, ipl, budget, k, train_calls, eval_calls",
    PLANS,
    ids=[f"{p[0]}B-ipl{p[1]}-budget{p[2]}" for p in PLANS],
)
def test_calls_per_loop_within_the_staging_budget(
    step_bytes, ipl, budget, k, train_calls, eval_calls
):
    got_k = plan.steps_per_call(budget=budget, step_bytes=step_bytes, iterations_per_loop=ipl)
    assert got_k == k
    assert plan.calls_per_loop(ipl, k, exact_tail=True) == train_calls
    assert plan.calls_per_loop(ipl, k, exact_tail=False) == eval_calls
    fit = max(1, budget // step_bytes)
    fewest = math.ceil(ipl / fit)
    for calls in (train_calls, eval_calls):
        assert sum(calls) == ipl  # every step of the loop runs, once
        assert all(c * step_bytes <= budget for c in calls) or fit == 1  # within the budget
    assert len(train_calls) <= fewest + fewest // 4  # at most a quarter more calls
    assert len(set(train_calls)) <= 2  # one length, and at most one tail
    # an eval tail is distinct powers of two, largest first
    tail = eval_calls[ipl // k :]
    assert all(t & (t - 1) == 0 for t in tail) and tail == sorted(set(tail), reverse=True)


@pytest.mark.parametrize("ipl", [1, 7, 100, 1000])
@pytest.mark.parametrize("fit", [1, 3, 64, 300, 5000])
def test_steps_per_call_fits_the_budget_and_spreads_the_loop_evenly(fit, ipl):
    """Over a grid of budgets (``fit`` steps) and loops, beyond the written-out rows above."""
    k = plan.steps_per_call(budget=fit * 10, step_bytes=10, iterations_per_loop=ipl)
    assert 1 <= k <= max(1, min(fit, ipl))
    calls = plan.calls_per_loop(ipl, k, exact_tail=True)
    assert sum(calls) == ipl and max(calls) - min(calls) <= (k if len(calls) > 1 else 0)
    fewest = -(-ipl // min(fit, ipl))
    if ipl % k == 0:  # one call length: at most a quarter more calls than the fewest
        assert len(calls) <= fewest + fewest // 4
    else:  # an even split: as few calls as the budget allows
        assert len(calls) == fewest


def test_eval_call_lengths_are_few_whatever_the_tail():
    k = 8
    lengths = {c for n in range(1, 200) for c in plan.calls_per_loop(n, k, exact_tail=False)}
    assert lengths == {1, 2, 4, 8}


@pytest.mark.parametrize(
    "configured, platform, devices, mode, per_device",
    [
        (None, "tpu", 8, "train", 256 * 2**20),
        (None, "gpu", 1, "train", 256 * 2**20),
        (None, "tpu", 8, "eval", 256 * 2**20),
        (None, "cpu", 1, "train", 2 * 2**20),
        (None, "cpu", 8, "train", 2**18),  # simulated devices share the host's memory
        (None, "cpu", 8, "infer", 2**18),
        (None, "cpu", 8, "eval", 2**20),  # evaluation fetches every call's outputs
        (3000, "cpu", 8, "eval", 3000),  # a configured budget is per device everywhere
        (3000, "tpu", 8, "train", 3000),
    ],
)
def test_default_budget_depends_on_the_platform(configured, platform, devices, mode, per_device):
    got = plan.input_budget(configured, platform=platform, local_devices=devices, mode=mode)
    assert got == per_device


@pytest.mark.parametrize(
    "fit, ipl, loops",
    [
        (1, 1, 1),  # one step fits: one loop
        (9, 10, 1),  # less than a loop fits: still one
        (15, 10, 1),  # 1.5 loops fit: whole loops only
        (20, 10, 2),
        (35, 10, 3),  # 3.5 loops fit: whole loops only
        (80, 10, 8),
        (10_000, 1, plan.MAX_LOOPS_PER_CALL),  # bounded
    ],
)
def test_loops_per_call_counts_whole_loops_that_fit(fit, ipl, loops):
    got = plan.loops_per_call(budget=fit * 100, step_bytes=100, iterations_per_loop=ipl)
    assert got == loops == max(1, min(plan.MAX_LOOPS_PER_CALL, fit // ipl))


def _calls(loops: list[int], *, k: int, exact_tail: bool, merge: int = 1) -> list[plan.Call]:
    it = iter([*loops, 0])
    return list(plan.plan_calls(lambda: next(it), k=k, exact_tail=exact_tail, merge=merge))


@pytest.mark.parametrize(
    "loops, k, exact_tail, merge, expected",
    [
        # training: each loop its own calls, the loop's end on its last call
        (
            [4, 4, 3],
            3,
            True,
            1,
            [(3, 4, ()), (1, 4, (1,)), (3, 4, ()), (1, 4, (1,)), (3, 3, (3,))],
        ),
        # evaluation: a 7-step loop with calls of 8 runs as powers of two, 4 + 2 + 1
        ([7], 8, False, 1, [(4, 7, ()), (2, 7, ()), (1, 7, (1,))]),
        # merged: three whole loops per call, the ends of each inside the call
        ([4, 4, 4, 4, 2], 4, False, 3, [(12, 4, (4, 8, 12)), (4, 4, (4,)), (2, 2, (2,))]),
    ],
    ids=["train", "eval-tail", "eval-merged"],
)
def test_plan_calls_marks_where_each_loop_ends(loops, k, exact_tail, merge, expected):
    calls = _calls(loops, k=k, exact_tail=exact_tail, merge=merge)
    assert [(c.steps, c.loop_steps, c.loop_ends) for c in calls] == expected
    assert sum(c.steps for c in calls) == sum(loops)
    assert sum(len(c.loop_ends) for c in calls) == len(loops)  # every loop ends exactly once
    assert all(c.ends_loop == bool(c.loop_ends) for c in calls)  # ends sit at a call's end


@pytest.mark.parametrize(
    "loops, merge, expected",
    [
        ([4] * 7, 3, [12, 12, 4]),  # two merged calls, one whole loop left
        ([4] * 6 + [3], 3, [12, 12, 2, 1]),  # a short last loop: powers of two
        ([4] * 2 + [1], 3, [4, 4, 1]),  # fewer loops than a merged call
        ([4] * 5, 1, [4] * 5),  # no merging
    ],
)
def test_eval_calls_merge_whole_loops(loops, merge, expected):
    calls = _calls(loops, k=4, exact_tail=False, merge=merge)
    assert [c.steps for c in calls] == expected
    assert sum(c.steps for c in calls) == sum(loops)


@pytest.mark.parametrize(
    "n, loop, expected", [(35, 10, [10, 10, 10, 4, 1]), (7, 10, [4, 2, 1]), (20, 10, [10, 10])]
)
def test_a_call_cut_short_splits_into_whole_loops_then_powers_of_two(n, loop, expected):
    assert plan.split_steps(n, loop) == expected


def test_plan_calls_stops_at_the_first_empty_loop():
    assert _calls([], k=4, exact_tail=True) == []
    it = iter([2, -1, 5])
    calls = list(plan.plan_calls(lambda: next(it), k=4, exact_tail=True))
    assert [c.steps for c in calls] == [2]  # a negative count ends the plan, 5 is never read


@pytest.mark.parametrize(
    "n, expected", [(0, []), (1, [1]), (7, [4, 2, 1]), (13, [8, 4, 1]), (16, [16])]
)
def test_powers_of_two_written_out(n, expected):
    assert plan.powers_of_two(n) == expected


@pytest.mark.parametrize("n", range(0, 70))
def test_powers_of_two_sum_to_n_and_are_distinct(n):
    parts = plan.powers_of_two(n)
    assert sum(parts) == n and len(parts) == bin(n).count("1")
    assert parts == sorted(set(parts), reverse=True)


@pytest.mark.parametrize(
    "call, raised",
    [
        (lambda: plan.powers_of_two(-1), "negative"),
        (lambda: plan.calls_per_loop(4, 0, exact_tail=True), "positive"),
    ],
)
def test_bad_counts_are_errors(call, raised):
    with pytest.raises(EstimatorValueError, match=raised):
        call()


def test_docstring_examples():
    assert doctest.testmod(plan).failed == 0
