"""Test doubles: a fake estimator session, a fake clock, and a driver playing the estimator."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import numpy as np

from hooks import SessionRunContext, SessionRunHook, SessionRunValues, resolve_fetches


@dataclasses.dataclass
class FakeSession:
    """What the estimator passes hooks as ``session``; records checkpoint saves."""

    global_step: int = 0
    model_dir: str = "/tmp/fake_model_dir"
    mode: str = "train"
    saves: list[int] = dataclasses.field(default_factory=list)

    def save(self, step: int | None = None) -> str:
        step = self.global_step if step is None else step
        self.saves.append(step)
        return os.path.join(self.model_dir, f"ckpt-{step}")


class FakeClock:
    """A manual clock: ``clock()`` returns ``now``; ``advance`` moves it."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, secs: float) -> None:
        self.now += secs


def run_loops(
    hooks: Sequence[SessionRunHook],
    session: FakeSession,
    loop_sizes: Sequence[int],
    values: Callable[[np.ndarray], dict[str, np.ndarray]],
    *,
    clock: FakeClock | None = None,
    secs_per_step: float = 0.0,
    examples_per_step: int = 0,
) -> int:
    """Drives ``hooks`` the way the estimator does; returns the number of loops run.

    ``values(steps)`` gives every fetchable name's per-step values for a loop's steps.
    Stops after the loop in which a hook requested a stop; calls ``end`` unless a hook raised.
    """
    for hook in hooks:
        hook.begin()
    for hook in hooks:
        hook.after_create_session(session, None)
    loops = 0
    for n in loop_sizes:
        steps = np.arange(session.global_step + 1, session.global_step + n + 1, dtype=np.int64)
        ctx = SessionRunContext(None, session, steps=steps, examples_per_step=examples_per_step)
        args = [hook.before_run(ctx) for hook in hooks]
        if clock is not None:
            clock.advance(secs_per_step * n)
        session.global_step = int(steps[-1])
        available = values(steps)
        for hook, arg in zip(hooks, args, strict=True):
            results = None if arg is None else resolve_fetches(arg.fetches, available)
            hook.after_run(ctx, SessionRunValues(results))
        loops += 1
        if ctx.stop_requested:
            break
    for hook in hooks:
        hook.end(session)
    return loops


def use_clock(clock: FakeClock, *hooks: SessionRunHook) -> None:
    """Points every hook's private time source at ``clock``."""
    for hook in hooks:
        hook._clock = clock


def default_values(steps: np.ndarray) -> dict[str, np.ndarray]:
    """loss = step / 4, global_step = step."""
    return {"loss": steps.astype(np.float32) / 4, "global_step": steps.astype(np.int64)}
