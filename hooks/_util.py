"""Small helpers shared by the standard hooks (private)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from hooks.base import HookSession, SessionRunContext

logger = logging.getLogger("estimator")


def step_times(start: float, end: float, n: int) -> np.ndarray:
    """Estimated finish time of each of a loop's ``n`` steps, assuming equal step times.

    Hooks only observe the clock at loop boundaries; within a loop steps are spread evenly.
    """
    return start + (end - start) * np.arange(1, n + 1, dtype=np.float64) / max(n, 1)


def leading_dim(results: Any) -> int | None:
    """The first-axis length of the first array leaf of ``results`` (None if no leaf)."""
    if results is None:
        return None
    if isinstance(results, dict):
        items = list(results.values())
    elif isinstance(results, (list, tuple)):
        items = list(results)
    else:
        arr = np.asarray(results)
        return int(arr.shape[0]) if arr.ndim else 1
    for item in items:
        n = leading_dim(item)
        if n is not None:
            return n
    return None


def loop_end_step(run_context: SessionRunContext, session: HookSession | None) -> int | None:
    """Global step at the end of the loop: ``run_context.steps[-1]``, else the session's."""
    if len(run_context.steps):
        return int(run_context.steps[-1])
    session = run_context.session or session
    if session is not None:
        return int(session.global_step)
    return None
