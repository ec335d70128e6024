"""The SessionRunHook lifecycle, adapted to compiled device loops.

The estimator runs compiled loops of ``n`` steps (``n = iterations_per_loop``, the last loop
maybe shorter) and calls every hook ONCE PER LOOP, with TensorFlow's method names:

``begin()`` -> ``after_create_session(session, coord)`` -> for each loop {
``before_run(run_context)`` -> device loop -> ``after_run(run_context, run_values)`` }
-> ``end(session)``.

What differs from TensorFlow is what a hook sees: each leaf of ``run_values.results`` is a
numpy array whose first axis is the loop's steps (shape ``[n, ...]``), and
``run_context.steps`` holds the global step after each of those steps. A hook that wants to
act "every 3 steps" therefore acts at exactly steps 3, 6, 9, ... whatever the loop length.

Example:
  >>> import numpy as np
  >>> class PrintLoss(SessionRunHook):
  ...     def before_run(self, run_context):
  ...         return SessionRunArgs("loss")
  ...     def after_run(self, run_context, run_values):
  ...         for step, loss in zip(run_context.steps, run_values.results):
  ...             print(int(step), float(loss))
  >>> hook = PrintLoss()
  >>> ctx = SessionRunContext(None, None, steps=np.array([1, 2]))
  >>> args = hook.before_run(ctx)
  >>> hook.after_run(ctx, SessionRunValues(resolve_fetches(args.fetches, {"loss": [0.5, 0.25]})))
  1 0.5
  2 0.25
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

# A fetch is a name, or a (nested) list/tuple/dict of names.
Fetches = Any


@runtime_checkable
class HookSession(Protocol):
    """What the estimator hands hooks as ``session`` (there is no ``tf.Session`` here).

    Attributes:
      global_step: the current global step (after the last finished loop).
      model_dir: the estimator's model directory.
      mode: ``"train"``, ``"eval"`` or ``"infer"``.
    """

    @property
    def global_step(self) -> int: ...

    @property
    def model_dir(self) -> str: ...

    @property
    def mode(self) -> str: ...

    def save(self, step: int | None = None) -> str | None:
        """Writes a checkpoint of the current state (safe to rely on) and returns its path."""
        ...


class NanLossDuringTrainingError(RuntimeError):
    """Raised by ``NanTensorHook`` when the loss becomes NaN or infinite.

    Args:
      message: the error message; names the first bad global step when known.
      global_step: that step, also available as an attribute (``None`` when unknown).
    """

    def __init__(
        self, message: str = "NaN loss during training.", *, global_step: int | None = None
    ):
        super().__init__(message)
        self.global_step = global_step


class SessionRunArgs(NamedTuple):
    """What a hook asks for in ``before_run`` (TF's ``tf.estimator.SessionRunArgs``).

    Attributes:
      fetches: a name, or a (nested) list/tuple/dict of names. Names the estimator supplies:
        ``"loss"`` (replica-mean loss of each step), ``"global_step"`` (global step after each
        step) and, in training, the keys of a dict ``host_call``'s tensors.
      feed_dict: accepted for compatibility; unused (there is nothing to feed).
      options: accepted for compatibility; unused.
    """

    fetches: Fetches
    feed_dict: Any = None
    options: Any = None


class SessionRunValues(NamedTuple):
    """What a hook receives in ``after_run``.

    Attributes:
      results: mirrors the structure of the hook's ``fetches``; every leaf is a numpy array
        with the loop's steps on its first axis (``[n, ...]``).
      options: unused, for compatibility.
      run_metadata: unused, for compatibility.
    """

    results: Any
    options: Any = None
    run_metadata: Any = None


class SessionRunContext:
    """Per-loop context given to ``before_run`` and ``after_run``.

    Args:
      original_args: the merged ``SessionRunArgs`` of the loop (informational).
      session: the estimator's ``HookSession``.
      steps: global step after each step of the upcoming (in ``before_run``) or just-run
        (in ``after_run``) loop, int64 ``[n]``. In eval/predict, the 1-based batch counters.
      examples_per_step: global batch size, 0 when unknown.

    Example:
      >>> ctx = SessionRunContext(None, None, steps=[4, 5, 6], examples_per_step=32)
      >>> ctx.steps.tolist(), ctx.stop_requested
      ([4, 5, 6], False)
      >>> ctx.request_stop(); ctx.stop_requested
      True
    """

    def __init__(
        self,
        original_args: SessionRunArgs | None,
        session: HookSession | None,
        *,
        steps: Any = None,
        examples_per_step: int = 0,
    ):
        self._original_args = original_args
        self._session = session
        self._stop_requested = False
        self.steps = steps
        self.examples_per_step = int(examples_per_step or 0)

    @property
    def original_args(self) -> SessionRunArgs | None:
        return self._original_args

    @property
    def session(self) -> HookSession | None:
        return self._session

    @property
    def steps(self) -> np.ndarray:
        """int64 ``[n]``: the global step after each step of this loop (may be empty)."""
        return self._steps

    @steps.setter
    def steps(self, value: Any) -> None:
        if value is None:
            value = ()
        self._steps = np.asarray(value, dtype=np.int64).reshape(-1)

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def request_stop(self) -> None:
        """Asks the estimator to stop at the end of this loop."""
        self._stop_requested = True


class SessionRunHook:
    """Base class for hooks; every method is a no-op (TF's ``tf.estimator.SessionRunHook``).

    Hooks run once per device loop but see per-step values; see the module docstring.
    Exceptions raised by a hook propagate to the caller of ``train``/``evaluate``/``predict``.
    """

    def begin(self) -> None:
        """Called once before using the session (before the first loop)."""

    def after_create_session(self, session: HookSession, coord: Any) -> None:
        """Called once the state is initialized or restored; ``coord`` is unused (None)."""

    def before_run(self, run_context: SessionRunContext) -> SessionRunArgs | None:
        """Called before each device loop; may return ``SessionRunArgs`` naming fetches."""
        return None

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """Called after each device loop with per-step values of what ``before_run`` fetched."""

    def end(self, session: HookSession) -> None:
        """Called at the end of the session (not called when a loop raised)."""

    def planned_last_step(self, start_step: int) -> int | None:
        """The global step this hook will stop training at, if it knows it in advance.

        Optional (not in TF's API). The estimator shortens the final device loop so training
        lands exactly on the smallest such step; ``None`` (the default) means no plan.
        """
        return None


def as_hook_list(hooks: Any, field: str = "hooks") -> list[SessionRunHook]:
    """``hooks`` (None or an iterable of SessionRunHook) as a list, checked.

    Raises:
      TypeError: a single hook instead of a list (a common slip), a non-iterable, or an
        entry that is not a SessionRunHook; the message names ``field``.
    """
    if hooks is None:
        return []
    if isinstance(hooks, SessionRunHook):
        raise TypeError(
            f"{field} must be a list of SessionRunHook, got a single "
            f"{type(hooks).__name__}; pass [hook]"
        )
    if isinstance(hooks, (str, bytes)) or not hasattr(hooks, "__iter__"):
        raise TypeError(f"{field} must be a list of SessionRunHook, got {type(hooks).__name__}")
    out = list(hooks)
    for hook in out:
        if not isinstance(hook, SessionRunHook):
            raise TypeError(
                f"All hooks in {field} must be SessionRunHook instances, given: {hook!r}"
            )
    return out


def resolve_fetches(fetches: Fetches, lookup: Mapping[str, Any] | Callable[[str], Any]) -> Any:
    """Replaces every name in ``fetches`` by its value, keeping the structure.

    For the estimator: builds ``SessionRunValues.results`` from a hook's fetches. Lists,
    tuples (named ones too) and dicts are mirrored; every leaf must be a ``str``.

    Args:
      fetches: a name or a nested list/tuple/dict of names (``None`` gives ``None``).
      lookup: a mapping or a function from name to value (raising ``KeyError`` when unknown).

    Returns:
      The same structure with numpy arrays at the leaves.

    Example:
      >>> resolve_fetches({"a": "loss", "b": ["loss"]}, {"loss": [1.0]})
      {'a': array([1.]), 'b': [array([1.])]}
    """
    get = lookup.__getitem__ if isinstance(lookup, Mapping) else lookup
    return _map_names(fetches, lambda name: np.asarray(get(name)))


def fetch_names(fetches: Fetches) -> list[str]:
    """The distinct names in ``fetches``, in first-seen order.

    Example:
      >>> fetch_names({"b": "loss", "a": ("global_step", "loss")})
      ['loss', 'global_step']
    """
    seen: dict[str, None] = {}
    _map_names(fetches, lambda name: seen.setdefault(name))
    return list(seen)


def _map_names(fetches: Fetches, fn: Callable[[str], Any]) -> Any:
    if fetches is None:
        return None
    if isinstance(fetches, str):
        return fn(fetches)
    if isinstance(fetches, Mapping):
        mapped = {k: _map_names(v, fn) for k, v in fetches.items()}
        try:
            return type(fetches)(mapped)
        except TypeError:  # a Mapping type that cannot be built from a dict
            return mapped
    if isinstance(fetches, tuple) and hasattr(fetches, "_fields"):
        return type(fetches)(*(_map_names(v, fn) for v in fetches))
    if isinstance(fetches, (list, tuple)):
        return type(fetches)(_map_names(v, fn) for v in fetches)
    raise TypeError(
        f"Fetches must be a name (str) or a list/tuple/dict of names, got "
        f"{type(fetches).__name__}: {fetches!r}"
    )
