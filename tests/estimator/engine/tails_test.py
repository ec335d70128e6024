"""The tail policy: a masked full-length call or calls of its own, by measured cost."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from estimator.data import plan
from estimator.engine import tails


def test_docstring_examples():
    import doctest

    assert doctest.testmod(tails).failed == 0


@pytest.mark.parametrize(
    "real, planned, compiled, compile_s, step_s, pads",
    [
        (29, 32, set(), None, None, True),  # the parity job: 1 program instead of 2
        (28, 32, {4}, None, None, False),  # 7 whole loops: their program exists, no padding
        (28, 32, {32}, None, None, True),  # the planned program exists: none new at all
        (4, 32, {32}, None, None, True),  # 28 padding steps save one program
        (3, 200, set(), None, None, False),  # 197 padding steps: more than a program is worth
        (3, 4, {4, 2, 1}, 0.5, 1e-4, False),  # every program exists: no padding
        (29, 32, {32}, 0.5, 1e-4, True),  # 3 steps (0.3 ms) against 2 compiles (1 s)
        (29, 32, {32}, 0.5, 1.0, False),  # a slow model: 3 s of padding against 1 s
        (1, 64, {64}, 2.0, 0.01, True),  # 0.63 s of padding against a 2 s compile
    ],
)
def test_pad_tail_picks_the_cheaper_option(real, planned, compiled, compile_s, step_s, pads):
    assert (
        tails.pad_tail(real, planned, 4, compiled=compiled, compile_s=compile_s, step_s=step_s)
        is pads
    )


def test_a_tie_in_programs_splits():
    """Padding that saves no program is never taken (it only wastes steps)."""
    for real in range(1, 32):
        split = set(plan.split_steps(real, 4))
        if len(split) == 1:
            assert not tails.pad_tail(real, 32, 4, compiled=set(), compile_s=None, step_s=None)


class _Chunk(NamedTuple):
    host_mask: np.ndarray


def test_call_costs_measure_compiles_and_step_time(monkeypatch):
    """A new length's launch time counts as its compile; step time comes from the gaps
    between calls of programs that existed."""
    # Per call: launch start, launch end, outputs on the host.
    clock = iter([0.0, 2.0, 2.0, 2.5, 2.6, 2.6, 2.7, 2.8, 2.8])

    monkeypatch.setattr(tails.time, "perf_counter", lambda: next(clock))
    costs = tails.CallCosts()
    chunks = [_Chunk(np.ones((4, 2), bool)) for _ in range(3)]

    def fetched(launch):
        for c in chunks:
            yield c, launch(c)

    list(tails.measured(costs, lambda c: None, fetched))
    assert costs.lengths == {4}
    assert costs.compile_s == [2.0]  # the first call's launch: 0.0 -> 2.0
    # Finished at 2.0 (a new program: left out), 2.6 and 2.8: (0.6 + 0.2) s over 8 steps.
    assert costs.step_s == pytest.approx(0.1)


def test_a_program_compiling_ahead_counts_as_existing():
    costs = tails.CallCosts()
    done = costs.ahead(32)
    assert costs.pad(29, 32, 4)  # the eval program compiling ahead makes the padded call free
    done(1.5)
    assert costs.compile_s == [1.5]


def test_repeated_tails_compile_their_program_once_padding_would_have_paid_for_it():
    """Ski rental: each evaluate's padded tail wastes steps again, the compile is paid
    once; once the padding already run (plus this tail's) costs more than the compile, the
    tail runs split, as the benchmark's CNN evaluation (100 steps in calls of 30) does."""
    costs = tails.CallCosts()
    costs.lengths, costs.compile_s = {30}, [0.2]
    costs._step_sum, costs._step_count = 0.02 * 30, 30  # 20 ms a step
    decisions = [costs.pad(10, 30, 10) for _ in range(4)]
    # 20 padding steps are 0.4 s: more than one program (0.2 s) at once: split at once.
    assert decisions == [False] * 4
    cheap = tails.CallCosts()
    cheap.lengths, cheap.compile_s = {30}, [0.2]
    cheap._step_sum, cheap._step_count = 0.002 * 30, 30  # 2 ms a step: 40 ms per tail
    decisions = [cheap.pad(10, 30, 10) for _ in range(6)]
    assert decisions == [True, True, True, True, False, False]  # 160 ms, then 200 >= 200
    assert cheap.padded == 80
    assert tails.pad_tail(10, 30, 10, compiled={30}, compile_s=0.2, step_s=0.002, padded=0)
    assert not tails.pad_tail(10, 30, 10, compiled={30}, compile_s=0.2, step_s=0.002, padded=100)
