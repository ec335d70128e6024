"""Tests for hooks.StepCounterHook: rates with a fake clock, logs and summaries."""

import logging

import pytest

import hooks
from tests.hooks._fakes import FakeClock, FakeSession, default_values, run_loops, use_clock


class RecordingWriter:
    def __init__(self):
        self.scalars = []
        self.flushed = 0

    def add_scalar(self, tag, value, global_step):
        self.scalars.append((tag, value, global_step))

    def flush(self):
        self.flushed += 1


def test_rates_logs_and_summaries(caplog):
    caplog.set_level(logging.INFO, logger="estimator")
    writer = RecordingWriter()
    hook = hooks.StepCounterHook(every_n_steps=10, summary_writer=writer)
    clock = FakeClock()
    use_clock(clock, hook)
    # Loops of 5 steps, 0.5 s per step => 2 steps/s, 64 examples/s with batch 32.
    run_loops(
        [hook], FakeSession(), [5] * 6, default_values,
        clock=clock, secs_per_step=0.5, examples_per_step=32,
    )  # fmt: skip
    assert hook.steps_per_sec == pytest.approx(2.0)
    assert hook.examples_per_sec == pytest.approx(64.0)
    # Step 5 starts the clock (compilation excluded); reports at 15 and 25.
    assert writer.scalars == [
        ("global_step/sec", pytest.approx(2.0), 15),
        ("examples/sec", pytest.approx(64.0), 15),
        ("global_step/sec", pytest.approx(2.0), 25),
        ("examples/sec", pytest.approx(64.0), 25),
    ]
    assert writer.flushed == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "estimator"]
    assert lines == ["global_step/sec: 2", "examples/sec: 64"] * 2


def test_rate_over_steps_since_last_report():
    hook = hooks.StepCounterHook(every_n_steps=4)
    clock = FakeClock()
    use_clock(clock, hook)
    hook.begin()
    session = FakeSession()
    for n, secs in [(4, 100.0), (4, 2.0), (2, 1.0), (2, 3.0)]:
        steps = range(session.global_step + 1, session.global_step + n + 1)
        session.global_step += n
        clock.advance(secs)
        hook.after_run(hooks.SessionRunContext(None, session, steps=steps), None)
    # Reports at step 8 (4 steps / 2 s) and step 12 (4 steps / 4 s); no examples/sec.
    assert hook.steps_per_sec == pytest.approx(1.0)
    assert hook.examples_per_sec is None


def test_every_n_secs():
    hook = hooks.StepCounterHook(every_n_steps=None, every_n_secs=10)
    clock = FakeClock()
    use_clock(clock, hook)
    run_loops([hook], FakeSession(), [10] * 5, default_values, clock=clock, secs_per_step=0.4)
    # Loops end every 4 s: start at step 10 (t=4), report at step 40 (t=16): 30 steps / 12 s.
    assert hook.steps_per_sec == pytest.approx(2.5)


def test_output_dir_writes_event_file(tmp_path):
    hook = hooks.StepCounterHook(every_n_steps=1, output_dir=str(tmp_path))
    clock = FakeClock()
    use_clock(clock, hook)
    run_loops([hook], FakeSession(), [2, 2], default_values, clock=clock, secs_per_step=1.0)
    assert hooks.read_eval_metrics(str(tmp_path)) == {4: {"global_step/sec": 1.0}}


def test_invalid_arguments():
    with pytest.raises(ValueError):
        hooks.StepCounterHook(every_n_steps=10, every_n_secs=10)
    with pytest.raises(ValueError):
        hooks.StepCounterHook(every_n_steps=None)
