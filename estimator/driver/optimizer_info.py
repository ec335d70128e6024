"""What the host can read of an optax optimizer without changing model_fn: its learning rate
at a step, and a name for it.

optax builds an optimizer from closures: ``optax.adam(schedule)`` is a ``chain`` of
``scale_by_adam`` and ``scale_by_learning_rate(schedule)``, which is ``scale_by_schedule``
(or ``scale`` for a float) holding ``-schedule(count)``. Walking the transformation's
closures finds those step sizes; the learning rate at a step is the magnitude of their
product there (the factor every update is scaled by). Wrappers that keep the optimizer in a
closure (``chain``, ``masked``, ``apply_if_finite``, ``CrossShardOptimizer``, ...) are walked
through. It cannot be read when no step size is found (a transformation of one's own that
scales by its own rule), when ``multi_transform`` gives parameter groups their own rates, or
when a schedule fails on the host; ``optax.inject_hyperparams`` then makes it readable. A
factor kept in the optimizer state (``optax.contrib.reduce_on_plateau``'s scale) is not seen:
the rate is that of the step sizes alone.

Example:
  >>> rate = learning_rate_fn(optax.adam(optax.cosine_decay_schedule(1e-3, 100)))
  >>> rate.at(0)
  0.001
  >>> optimizer_name(optax.adamw(1e-3))
  'adam+add_decayed_weights'
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax

_MAX_NODES = 5000  # objects visited in one walk: a closure may hold large structures
_MAX_ITEMS = 64  # a container longer than this is not an optimizer's part
_SCALE = "scale.<locals>.update_fn"
_SCHEDULE = "scale_by_schedule.<locals>.update_fn"
# Transformations that only scale the update: not part of the optimizer's name.
_PLUMBING = {
    "chain",
    "named_chain",
    "with_extra_args_support",
    "identity",
    "scale",
    "scale_by_schedule",
    "scale_by_learning_rate",
    "inject_hyperparams",
}
_READABLE = {"trace": "momentum", "rms": "rmsprop"}  # transformations named as optimizers


@dataclasses.dataclass(frozen=True)
class LearningRate:
    """The learning rate an optimizer's step sizes give: constants times schedules."""

    constant: float
    schedules: tuple[Callable[[Any], Any], ...]

    def at(self, count: int) -> float:
        """The rate of the update whose optimizer count is ``count`` (0 for the first)."""
        value = self.constant
        for schedule in self.schedules:
            value *= float(np.asarray(schedule(count)))
        return abs(value)


@dataclasses.dataclass
class _Found:
    """What one walk over an optimizer's closures found."""

    constants: list = dataclasses.field(default_factory=list)
    schedules: list = dataclasses.field(default_factory=list)
    names: list = dataclasses.field(default_factory=list)
    groups: bool = False  # several optimizers for parameter groups (multi_transform)
    visited: int = 0


def learning_rate_fn(tx: Any) -> LearningRate | None:
    """The learning rate of ``tx`` as a function of the optimizer count, or None when it
    cannot be read (see the module docstring)."""
    found = _walk(tx)
    if found.groups or not (found.constants or found.schedules):
        return None
    return LearningRate(math.prod(found.constants), tuple(found.schedules))


def optimizer_name(tx: Any) -> str:
    """A name for ``tx`` from its parts: ``adam`` for ``optax.adam``,
    ``adam+add_decayed_weights`` for ``adamw``, ``momentum`` for ``sgd(momentum=...)``,
    ``sgd`` when only step sizes are left (``optax.sgd``)."""
    names = [n.removeprefix("scale_by_") for n in _walk(tx).names if n not in _PLUMBING]
    names = [_READABLE.get(n, n) for n in names]
    return "+".join(dict.fromkeys(names)) or "sgd"


def schedule_count(opt_state: Any) -> int | None:
    """The count of the one ``ScaleByScheduleState`` in ``opt_state`` (updates applied so
    far), or None when there is not exactly one."""
    counts = [
        node.count
        for node in jax.tree.leaves(
            opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState)
        )
        if isinstance(node, optax.ScaleByScheduleState)
    ]
    if len(counts) != 1:
        return None
    count = counts[0]
    if isinstance(count, jax.Array):
        count = count.addressable_shards[0].data  # replicated: this process's own copy
    return int(np.asarray(count).reshape(()))


def _walk(tx: Any) -> _Found:
    found, seen = _Found(), set()
    _visit(tx, found, seen)
    return found


def _visit(obj: Any, found: _Found, seen: set) -> None:
    if id(obj) in seen or found.visited >= _MAX_NODES:
        return
    seen.add(id(obj))
    found.visited += 1
    if isinstance(obj, optax.GradientTransformation):
        _visit(obj.update, found, seen)
    elif isinstance(obj, functools.partial):
        for part in (obj.func, *obj.args, *obj.keywords.values()):
            _visit(part, found, seen)
    elif isinstance(obj, Mapping) and len(obj) <= _MAX_ITEMS:
        txs = [v for v in obj.values() if isinstance(v, optax.GradientTransformation)]
        found.groups = found.groups or len(txs) > 1
        for value in obj.values():
            _visit(value, found, seen)
    elif isinstance(obj, list | tuple) and len(obj) <= _MAX_ITEMS:
        for item in obj:
            _visit(item, found, seen)
    elif hasattr(obj, "__func__") and hasattr(obj, "__self__"):  # a bound method
        _visit(obj.__func__, found, seen)
        _visit(getattr(obj.__self__, "__dict__", None) or {}, found, seen)
    elif callable(obj) and hasattr(obj, "__code__"):
        _visit_function(obj, found, seen)


def _visit_function(fn: Any, found: _Found, seen: set) -> None:
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False))
    values = {}
    for name, cell in cells.items():
        try:
            values[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    optax_fn = getattr(fn, "__module__", "").startswith("optax")
    if optax_fn:
        qualname = fn.__qualname__
        if qualname == _SCALE and isinstance(values.get("step_size"), int | float):
            found.constants.append(float(values["step_size"]))
        elif qualname == _SCHEDULE and callable(values.get("step_size_fn")):
            found.schedules.append(values["step_size_fn"])
        if qualname.endswith(".<locals>.update_fn"):
            found.names.append(qualname.split(".", 1)[0])
        elif "<locals>" not in qualname and fn.__module__.endswith("alias"):
            found.names.append(fn.__name__)  # the optimizer inject_hyperparams builds
    if optax_fn and fn.__qualname__ in (_SCALE, _SCHEDULE):
        return  # its step size is counted; the schedule's own closure is not an optimizer
    for value in values.values():
        _visit(value, found, seen)
