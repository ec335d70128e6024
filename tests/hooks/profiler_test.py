"""Tests for hooks.ProfilerHook: real jax.profiler traces on CPU."""

import glob
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hooks
from tests.hooks._fakes import FakeSession


def _run(hook, session, loop_sizes):
    """Drives the hook around tiny jnp computations, one per loop."""
    hook.begin()
    hook.after_create_session(session, None)
    x = jnp.ones((64, 64))
    for n in loop_sizes:
        steps = np.arange(session.global_step + 1, session.global_step + n + 1)
        ctx = hooks.SessionRunContext(None, session, steps=steps)
        hook.before_run(ctx)
        for _ in range(n):
            x = (x @ x) / 64.0
        x.block_until_ready()
        session.global_step += n
        hook.after_run(ctx, hooks.SessionRunValues(None))
    hook.end(session)


def _traces(output_dir):
    return glob.glob(os.path.join(output_dir, "plugins", "profile", "*", "*.xplane.pb"))


def test_save_steps_traces_under_plugins_profile(tmp_path):
    hook = hooks.ProfilerHook(save_steps=4, output_dir=str(tmp_path))
    _run(hook, FakeSession(), [2] * 5)
    # The first (compiling) loop is skipped; then the loop ending at step 4, then 4 later.
    assert hook.traced_steps == [(3, 4), (7, 8)]
    assert _traces(str(tmp_path))


def test_chosen_steps_and_default_dir_is_model_dir(tmp_path):
    hook = hooks.ProfilerHook(steps=[1, 6])
    _run(hook, FakeSession(model_dir=str(tmp_path)), [3, 3, 3])
    assert hook.traced_steps == [(1, 3), (4, 6)]
    assert _traces(str(tmp_path))


def test_skips_when_another_trace_runs(tmp_path, caplog):
    hook = hooks.ProfilerHook(steps=[1], output_dir=str(tmp_path / "hook"))
    jax.profiler.start_trace(str(tmp_path / "other"))
    try:
        _run(hook, FakeSession(), [2])
    finally:
        jax.profiler.stop_trace()  # still ours to stop: the hook did not touch it
    assert hook.traced_steps == []
    assert any(
        "not tracing" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
    )


def test_end_stops_a_dangling_trace(tmp_path):
    hook = hooks.ProfilerHook(steps=[1], output_dir=str(tmp_path))
    hook.begin()
    hook.before_run(hooks.SessionRunContext(None, None, steps=[1]))
    hook.end(FakeSession())  # the loop raised: after_run never ran
    jax.profiler.start_trace(str(tmp_path))  # would raise if the hook's trace still ran
    jax.profiler.stop_trace()


@pytest.mark.parametrize(
    "kwargs", [{}, {"save_steps": 1, "save_secs": 1}, {"save_steps": 1, "steps": [1]}]
)
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        hooks.ProfilerHook(**kwargs)
