"""Tests for hooks.timer.SecondOrStepTimer."""

import pytest

from hooks import SecondOrStepTimer
from tests.hooks._fakes import FakeClock


@pytest.mark.parametrize("kwargs", [{}, {"every_secs": 1, "every_steps": 1}, {"every_steps": 0}])
def test_needs_exactly_one_positive_interval(kwargs):
    with pytest.raises(ValueError):
        SecondOrStepTimer(**kwargs)


def test_steps():
    timer = SecondOrStepTimer(every_steps=5)
    assert timer.should_trigger_for_step(3)
    assert timer.update_last_triggered_step(3) == (None, None)
    assert timer.last_triggered_step() == 3
    assert not timer.should_trigger_for_step(3)
    assert not timer.should_trigger_for_step(7)
    assert timer.should_trigger_for_step(8)
    secs, steps = timer.update_last_triggered_step(9)
    assert steps == 6 and secs >= 0
    timer.reset()
    assert timer.should_trigger_for_step(9)


def test_secs():
    clock = FakeClock(100.0)
    timer = SecondOrStepTimer(every_secs=10, clock=clock)
    timer.update_last_triggered_step(1)
    clock.advance(9.5)
    assert not timer.should_trigger_for_step(50)
    clock.advance(0.5)
    assert timer.should_trigger_for_step(50)
    assert timer.should_trigger_for_step(2, now=200.0)
    assert timer.update_last_triggered_step(50) == (10.0, 49)
