"""What model_fn can ask for while the estimator is calling it: the padding mask and global step.

Example:
  >>> def model_fn(features, labels, mode, params):
  ...     mask = estimator.padding_mask()          # 1.0 for real rows, 0.0 for padding
  ...     per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  ...     loss = (per_row * mask).sum() / jnp.maximum(mask.sum(), 1.0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

import jax.numpy as jnp

from .errors import EstimatorRuntimeError

_LOCAL = threading.local()


@dataclasses.dataclass(frozen=True)
class CallContext:
    """The per-call values the estimator provides to model_fn (traced arrays)."""

    mode: str
    mask: Any  # float32 [per-replica batch]
    global_step: Any  # int32 scalar
    initializing: bool = False  # model_fn is traced only to create variables
    # What this call of model_fn did that the estimator acts on afterwards (e.g. it read the
    # padding mask, or called init_from_checkpoint): the ModelFn keeps the last trace's notes.
    notes: dict = dataclasses.field(default_factory=dict, compare=False)


@contextlib.contextmanager
def calling_model_fn(ctx: CallContext):
    """Makes ``ctx`` current while model_fn runs (tracing happens on the caller's thread)."""
    stack = _LOCAL.__dict__.setdefault("stack", [])
    stack.append(ctx)
    try:
        yield ctx
    finally:
        stack.pop()


def current() -> CallContext | None:
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def root_module(module: Any):
    """Makes the bound Flax module model_fn builds under current while model_fn runs (its
    variables are what ``estimator.trainable_variables()`` returns)."""
    stack = _LOCAL.__dict__.setdefault("modules", [])
    stack.append(module)
    try:
        yield module
    finally:
        stack.pop()


def current_root_module() -> Any:
    """The bound root module of the model_fn running now, or None."""
    stack = getattr(_LOCAL, "modules", None)
    return stack[-1] if stack else None


#: The note naming the trainable variables model_fn built (``ExponentialMovingAverage.
#: variables_to_restore()`` reads it after the call, e.g. inside scaffold_fn).
PARAM_NAMES = "param_names"
_LAST: dict[str, Any] = {}  # what the last call of any model_fn noted process-wide


def note_param_names(names: list[str]) -> None:
    """Records the names of the variables model_fn built, in the current call's notes and as
    the last call's (read by code that runs after model_fn, such as scaffold_fn)."""
    ctx = current()
    if ctx is not None:
        ctx.notes[PARAM_NAMES] = names
    _LAST[PARAM_NAMES] = names


def last_param_names() -> list[str] | None:
    """The variable names the last traced model_fn built (None before any)."""
    return _LAST.get(PARAM_NAMES)


def padding_mask() -> jnp.ndarray:
    """The per-row mask of this replica's batch: 1.0 for real examples, 0.0 for padding.

    Evaluation and prediction pad the final partial batch to the static batch shape; use the
    mask to keep padded rows out of the loss. In training every row is real.

    Raises:
      RuntimeError: outside a model_fn called by the estimator.
    """
    ctx = current()
    if ctx is None:
        raise EstimatorRuntimeError("estimator.padding_mask() can only be called inside model_fn")
    ctx.notes["padding_mask"] = True  # its loss is taken as masked (see driver/eval_loss.py)
    return ctx.mask


def get_global_step() -> jnp.ndarray:
    """The global step (an int32 scalar array) of the step model_fn is computing.

    Raises:
      RuntimeError: outside a model_fn called by the estimator.
    """
    ctx = current()
    if ctx is None:
        raise EstimatorRuntimeError(
            "estimator.get_global_step() can only be called inside model_fn"
        )
    return ctx.global_step


def get_or_create_global_step() -> jnp.ndarray:
    """TF's ``tf.train.get_or_create_global_step()``: the global step inside model_fn (the
    estimator owns the step, so there is nothing to create). The same as
    ``get_global_step()``; host_call summaries take it as TF programs do
    (``gs = get_or_create_global_step(); host_call = (fn, [gs.reshape([1]), ...])``).

    Raises:
      RuntimeError: outside a model_fn called by the estimator.
    """
    if current() is None:
        raise EstimatorRuntimeError(
            "estimator.get_or_create_global_step() can only be called inside model_fn: the "
            "estimator owns the step (read it afterwards with est.latest_checkpoint() or "
            "the global_step in evaluate's results)"
        )
    return get_global_step()
