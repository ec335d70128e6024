"""``ExponentialMovingAverage``: TF's moving-average weights as an optax wrapper.

``ema.apply(tx)`` wraps the train_op: its state holds ``tx``'s state, the number of updates
applied and a shadow copy of the parameters, which starts at the initial weights (TF's
initialisation) and after every update becomes

    shadow = decay * shadow + (1 - decay) * new_params

on the device, in the same compiled step. Being optimizer state, the shadow is checkpointed
and resumed with it and, under ``TPUConfig(shard_optimizer_state=True)``, split over the
replicas like Adam's slots. Checkpoints name it as TF did, ``<variable>/ExponentialMovingAverage``
(``estimator.list_variables``, ``estimator.load_variable``, ``est.get_variable_value``).

Two ways to evaluate, predict and export with the averaged weights:

* ported code: ``scaffold_fn=lambda: estimator.Scaffold(saver=estimator.Saver(
  ema.variables_to_restore()))`` in the EVAL/PREDICT spec, as TF programs wrote it;
* new code: ``ExponentialMovingAverage(decay, use_for_eval=True)``: evaluate, predict and
  export read the shadow instead of the raw weights, with no change to model_fn (the choice
  is stored with the shadow in each checkpoint; see docs/moving-average.md).

Example:
  >>> ema = estimator.ExponentialMovingAverage(0.999, num_updates=True, use_for_eval=True)
  >>> def model_fn(features, labels, mode, params):
  ...     ...
  ...     return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=ema.apply(optax.adam(1e-3)))
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from . import context
from .engine import multi_loss
from .errors import EstimatorTypeError, EstimatorValueError
from .io import variables as variables_lib

#: TF's name of the shadow variables: ``<variable>/ExponentialMovingAverage``.
NAME = variables_lib.MOVING_AVERAGE


class MovingAverageState(NamedTuple):
    """The state of ``ExponentialMovingAverage.apply(tx)``.

    The field ``ExponentialMovingAverage`` is the shadow (a copy of the params tree); its
    name is what checkpoints' naming rule looks for (``io/variables.moving_average_names``).
    """

    inner_state: Any
    num_updates: jax.Array  # int32: updates applied so far
    use_for_eval: jax.Array  # int32 0/1: evaluate/predict/export read the shadow
    ExponentialMovingAverage: Any  # noqa: N815 - TF's name, which checkpoints show


def _copy(x: Any) -> Any:
    # A fresh buffer (the shadow and the params are donated separately); anything without a
    # shape (optax's placeholder in tree_map_params) passes through so the shadow is found
    # as a copy of the params, and ZeRO splits it like them.
    return jnp.array(x, copy=True) if hasattr(x, "shape") else x


def _check_decay(decay: Any) -> float:
    if isinstance(decay, bool) or not isinstance(decay, numbers.Real):
        raise EstimatorTypeError(
            f"ExponentialMovingAverage decay must be a number in [0, 1], got {decay!r}"
        )
    if not 0.0 <= float(decay) <= 1.0:
        raise EstimatorValueError(f"ExponentialMovingAverage decay must be in [0, 1], got {decay}")
    return float(decay)


def _num_updates_mode(num_updates: Any) -> int | str | None:
    """None (plain decay), ``"count"`` (the global step) or a constant int."""
    if num_updates is None or num_updates is False:
        return None
    if num_updates is True or (isinstance(num_updates, str) and num_updates == "global_step"):
        return "count"
    ctx = context.current()
    if ctx is not None and num_updates is ctx.global_step:  # estimator.get_global_step()
        return "count"
    if isinstance(num_updates, numbers.Integral) and num_updates >= 0:
        return int(num_updates)
    raise EstimatorValueError(
        "ExponentialMovingAverage num_updates must be None, True (the global step), "
        f"estimator.get_global_step() inside model_fn, or an int >= 0; got {num_updates!r}"
    )


class ExponentialMovingAverage:
    """Moving averages of the parameters (TF's ``tf.train.ExponentialMovingAverage``).

    Args:
      decay: in [0, 1]; 0 keeps the raw weights, 1 the initial ones.
      num_updates: None: every update uses ``decay``. True (or ``"global_step"``, or
        ``estimator.get_global_step()`` inside model_fn): TF's rule with the global step,
        ``min(decay, (1 + n) / (10 + n))`` where ``n`` is the number of updates applied,
        this one included (the global step after the step; TF read it after the train op).
        An int: that constant ``n``.
      zero_debias: TF's option; only False (TF's default) is supported.
      name: TF's name prefix; only the default ``"ExponentialMovingAverage"``.
      use_for_eval: keyword-only; evaluate, predict and export read the averaged weights
        (the native route; without it, use ``variables_to_restore`` with a Saver).

    Example:
      >>> ema = estimator.ExponentialMovingAverage(0.99)
      >>> train_op = ema.apply(optax.sgd(0.1))
    """

    def __init__(
        self,
        decay: float,
        num_updates: Any = None,
        zero_debias: bool = False,
        name: str = NAME,
        *,
        use_for_eval: bool = False,
    ):
        self.decay = _check_decay(decay)
        self.num_updates = _num_updates_mode(num_updates)
        if zero_debias:
            raise EstimatorValueError(
                "ExponentialMovingAverage(zero_debias=True) is not supported; the shadow "
                "starts at the initial weights (TF's default, zero_debias=False)"
            )
        if name != NAME:
            raise EstimatorValueError(
                f"ExponentialMovingAverage name must be {NAME!r} (checkpoints name the "
                f"shadow <variable>/{NAME}); got {name!r}"
            )
        if not isinstance(use_for_eval, bool):
            raise EstimatorTypeError(f"use_for_eval must be a bool, got {use_for_eval!r}")
        self.name = name
        self.use_for_eval = use_for_eval
        self._names: list[str] | None = None  # the averaged params, once init has run
        # made inside model_fn: that call's notes name its variables once it has returned
        ctx = context.current()
        self._call_notes = ctx.notes if ctx is not None else None

    def decay_at(self, count: Any) -> Any:
        """The decay of the update that makes ``count`` updates applied (TF's rule)."""
        if self.num_updates is None:
            return jnp.float32(self.decay)
        n = (
            jnp.asarray(count, jnp.float32)
            if self.num_updates == "count"
            else jnp.float32(self.num_updates)
        )
        return jnp.minimum(jnp.float32(self.decay), (1.0 + n) / (10.0 + n))

    def apply(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        """``tx`` whose state also keeps the moving average of the parameters it updates.

        Raises:
          TypeError: ``tx`` is not an optax GradientTransformation.
        """
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise EstimatorTypeError(
                f"ExponentialMovingAverage.apply takes an optax GradientTransformation, got "
                f"{type(tx).__name__}"
            )

        def init(params):
            if hasattr(params, "keys") or isinstance(params, (list, tuple)):
                self._names = list(variables_lib.named_variables(params))
            return MovingAverageState(
                inner_state=tx.init(params),
                num_updates=jnp.zeros((), jnp.int32),
                use_for_eval=jnp.asarray(int(self.use_for_eval), jnp.int32),
                ExponentialMovingAverage=jax.tree.map(_copy, params),
            )

        def update(updates, state, params=None, **extra):
            if params is None:
                raise EstimatorValueError(
                    "ExponentialMovingAverage.apply(tx).update needs params (the estimator "
                    "passes them; call tx.update(grads, state, params))"
                )
            if not isinstance(state, MovingAverageState):
                raise EstimatorTypeError(
                    f"expected a MovingAverageState, got {type(state).__name__}"
                )
            inner = optax.with_extra_args_support(tx)
            updates, inner_state = inner.update(updates, state.inner_state, params, **extra)
            count = state.num_updates + 1
            decay = self.decay_at(count)
            new_params = optax.apply_updates(params, updates)
            # The convex form (not TF's shadow -= (1 - d) * (shadow - x)): decay 0 gives the
            # new weights and decay 1 the old shadow exactly.
            shadow = jax.tree.map(
                lambda s, p: (decay * s + (1.0 - decay) * p).astype(s.dtype),
                state.ExponentialMovingAverage,
                new_params,
            )
            return updates, MovingAverageState(
                inner_state, count, jnp.asarray(int(self.use_for_eval), jnp.int32), shadow
            )

        # a TrainOp (estimator.group) keeps its losses: TF's ema.apply after tf.group(...)
        return multi_loss.with_terms(tx, optax.GradientTransformationExtraArgs(init, update))

    def average_name(self, var: Any) -> str:
        """``"<name>/ExponentialMovingAverage"`` for a variable name (TF's ``average_name``)."""
        return f"{_var_name(var)}/{NAME}"

    def variables_to_restore(self, moving_avg_variables: Any = None) -> dict[str, str]:
        """TF's restore mapping ``{"<var>/ExponentialMovingAverage": "<var>"}``.

        For ``estimator.Saver`` / ``Scaffold(saver=...)``: evaluate, predict and export then
        read each averaged variable's shadow from the checkpoint.

        Args:
          moving_avg_variables: the averaged variables: a params pytree, a ``{name: value}``
            dict, or a list of names. None: TF's ``tf.trainable_variables()``: inside
            model_fn, the model's ``params``; elsewhere (scaffold_fn), those of the model_fn
            call this EMA was made in, else the params it was applied to, else those of the
            model_fn traced last.

        Raises:
          ValueError: None, before any model_fn was traced and the EMA applied.
        """
        names = _names_of(moving_avg_variables) if moving_avg_variables is not None else None
        if names is None:
            names = _model_param_names()
        if names is None and self._call_notes is not None:
            names = self._call_notes.get(context.PARAM_NAMES)
        if names is None:
            names = self._names
        if names is None:
            names = context.last_param_names()
        if names is None:
            raise EstimatorValueError(
                "ExponentialMovingAverage.variables_to_restore() needs the averaged variables: "
                "call it inside model_fn, or pass them (a params tree or a list of names)"
            )
        return {self.average_name(n): n for n in names}


def _var_name(var: Any) -> str:
    name = var if isinstance(var, str) else getattr(var, "name", None)
    if not isinstance(name, str):
        raise EstimatorTypeError(f"a variable name must be a str, got {var!r}")
    return name[:-2] if name.endswith(":0") else name


def _names_of(variables: Any) -> list[str]:
    if isinstance(variables, Mapping):
        return list(variables_lib.named_variables(dict(variables)))
    if isinstance(variables, Iterable) and not isinstance(variables, (str, bytes)):
        return [_var_name(v) for v in variables]
    raise EstimatorTypeError(
        "moving_avg_variables must be a params tree, a {name: value} dict or a list of "
        f"names, got {type(variables).__name__}"
    )


def _model_param_names() -> list[str] | None:
    """The ``params`` of the module model_fn builds under, inside model_fn (else None)."""
    if context.current() is None:
        return None
    from flax.linen import module as flax_module  # the compact scope model_fn runs in

    stack = getattr(getattr(flax_module, "_context", None), "module_stack", None)
    root = stack[-1] if stack else None
    if root is None or root.scope is None:
        return None
    params = root.variables.get(variables_lib.PARAMS, {})
    return list(variables_lib.named_variables(jax.tree.map(lambda x: x, dict(params))))


__all__ = ["ExponentialMovingAverage", "MovingAverageState"]
