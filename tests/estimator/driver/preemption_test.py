"""Stopping training on a signal (``driver/preemption.py``): SIGTERM and Ctrl-C are recorded
while ``StopSignals`` is active, the previous handlers come back afterwards, and the error
raised says which signal it was.

Signals are delivered to this process with ``signal.raise_signal``, which runs the handler
before it returns: nothing waits on time.
"""

from __future__ import annotations

import signal
import threading

import pytest

from estimator.driver import preemption
from estimator.driver.preemption import EXIT_STATUS, Preempted, StopSignals


@pytest.fixture
def handlers():
    """The handlers in place before the test, checked to be back afterwards."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield before
    assert {s: signal.getsignal(s) for s in before} == before


def _raise(stop: StopSignals, sig: int) -> None:
    """Delivers ``sig`` only while ``stop``'s handler is in place (SIGTERM's default handler
    would end the test process)."""
    ours = {signal.SIGTERM: stop._on_sigterm, signal.SIGINT: stop._on_sigint}[sig]
    assert signal.getsignal(sig) == ours
    signal.raise_signal(sig)


@pytest.mark.parametrize(
    "signals, reason",
    [
        ([signal.SIGTERM], "preempted"),
        ([signal.SIGINT], "interrupted"),
        ([signal.SIGINT, signal.SIGTERM], "preempted"),  # SIGTERM wins
        ([signal.SIGTERM, signal.SIGINT], "preempted"),
        ([signal.SIGTERM, signal.SIGTERM], "preempted"),
    ],
)
def test_a_signal_requests_a_stop(handlers, signals, reason):
    with StopSignals() as stop:
        assert not stop.requested and stop.reason is None
        assert preemption.active() is stop
        for s in signals:
            _raise(stop, s)
        assert stop.requested and stop.event.is_set() and stop.reason == reason
    assert preemption.active() is None


def test_a_second_ctrl_c_stops_at_once_and_restores_the_old_handler(handlers):
    with StopSignals() as stop:
        _raise(stop, signal.SIGINT)
        with pytest.raises(KeyboardInterrupt, match="aborted by a second Ctrl-C"):
            _raise(stop, signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == handlers[signal.SIGINT]
        assert signal.getsignal(signal.SIGTERM) == stop._on_sigterm  # still ours
    assert stop.reason == "interrupted"


def test_the_stop_error_names_the_signal_and_the_checkpoint():
    stop = StopSignals()
    stop.reason = "preempted"
    error = stop.stop_error(120, "/runs/a/model.ckpt-120")
    assert isinstance(error, Preempted) and isinstance(error, SystemExit)
    assert error.code == EXIT_STATUS == 128 + signal.SIGTERM
    assert (error.global_step, error.checkpoint) == (120, "/runs/a/model.ckpt-120")
    assert "checkpoint of step 120 saved to /runs/a/model.ckpt-120" in str(error)
    stop.reason = "interrupted"
    error = stop.stop_error(7, None)
    assert isinstance(error, KeyboardInterrupt)
    assert str(error) == "interrupted at step 7, checkpoint saved; run again to resume"


def test_outside_the_main_thread_no_handler_is_installed(handlers):
    seen = {}

    def body():
        with StopSignals() as stop:
            seen["active"] = preemption.active() is stop
            seen["handlers"] = {s: signal.getsignal(s) for s in handlers}

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(60)
    assert seen == {"active": True, "handlers": handlers}


def test_nested_stop_signals_restore_in_order(handlers):
    with StopSignals() as outer:
        with StopSignals() as inner:
            assert preemption.active() is inner
            _raise(inner, signal.SIGTERM)
        assert preemption.active() is outer
        assert signal.getsignal(signal.SIGTERM) == outer._on_sigterm
    assert inner.requested and not outer.requested
