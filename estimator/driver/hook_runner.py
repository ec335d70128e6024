"""Runs a list of SessionRunHooks around the device loops: once per loop, per-step values."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hooks import (
    SessionRunArgs,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
)
from hooks.base import as_hook_list, fetch_names, resolve_fetches

from ..core.errors import EstimatorKeyError, EstimatorRuntimeError


class Session:
    """What hooks see as ``session``: the step, the directory, and a way to checkpoint."""

    def __init__(
        self,
        *,
        mode: str,
        model_dir: str,
        global_step: int,
        save: Callable[[int | None], str | None] | None = None,
    ):
        self.mode = mode
        self.model_dir = model_dir
        self.global_step = global_step
        self._save = save

    def save(self, step: int | None = None) -> str | None:
        if self._save is None:
            raise EstimatorRuntimeError(
                f"checkpoints can only be saved while training, not in {self.mode}"
            )
        return self._save(step)


class HookRunner:
    """The SessionRunHook lifecycle over device loops."""

    def __init__(
        self, hooks: Sequence[SessionRunHook], session: Session, *, examples_per_step: int = 0
    ):
        self.hooks = as_hook_list(hooks)
        self.session = session
        self.examples_per_step = examples_per_step
        self._pending: list[tuple[SessionRunHook, SessionRunArgs | None]] = []
        self._context: SessionRunContext | None = None

    def begin(self) -> None:
        for h in self.hooks:
            h.begin()

    def after_create_session(self) -> None:
        for h in self.hooks:
            h.after_create_session(self.session, None)

    def before_run(self, steps: np.ndarray) -> list[str]:
        """Calls before_run; returns the names the hooks fetch."""
        self._context = SessionRunContext(
            None, self.session, steps=steps, examples_per_step=self.examples_per_step
        )
        self._pending = []
        names: list[str] = []
        for h in self.hooks:
            args = h.before_run(self._context)
            if args is not None and not isinstance(args, SessionRunArgs):
                args = SessionRunArgs(args)
            self._pending.append((h, args))
            if args is not None:
                names += [n for n in fetch_names(args.fetches) if n not in names]
        return names

    def after_run(self, values: dict[str, Any], steps: np.ndarray) -> bool:
        """Calls after_run with each hook's fetches resolved; returns whether to stop."""
        ctx = self._context
        ctx.steps = steps

        def lookup(name: str):
            if name not in values:
                raise EstimatorKeyError(
                    f"a hook fetched {name!r}, but the loop exposes only {sorted(values)}"
                )
            return values[name]

        for h, args in self._pending:
            results = None if args is None else resolve_fetches(args.fetches, lookup)
            h.after_run(ctx, SessionRunValues(results))
        return ctx.stop_requested

    def end(self) -> None:
        for h in self.hooks:
            h.end(self.session)
