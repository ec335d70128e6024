"""``ExponentialMovingAverage``: TF's moving-average weights as an optax wrapper.

``ema.apply(tx)`` wraps the train_op: its state holds ``tx``'s state, the number of updates
applied and a shadow copy of the parameters, which starts at the initial weights (TF's
initialisation) and after every update becomes

    shadow = decay * shadow + (1 - decay) * new_params

on the device, in the same compiled step. Being optimizer state, the shadow is checkpointed
and resumed with it and, under ``TPUConfig(shard_optimizer_state=True)``, split over the
replicas like Adam's slots. Checkpoints name it as TF did, ``<variable>/ExponentialMovingAverage``
(``estimator.list_variables``, ``estimator.load_variable``, ``est.get_variable_value``).

TF's form, EfficientNet's and MnasNet's, averages chosen variables, BatchNorm's moving
statistics included, after the optimizer; it reads the same here:

    ema = estimator.ExponentialMovingAverage(decay, num_updates=global_step)
    ema_vars = estimator.trainable_variables() + estimator.get_collection("moving_vars")
    train_op = optimizer                        # optimizer.minimize(loss, global_step)
    with estimator.control_dependencies([train_op]):
        train_op = ema.apply(ema_vars)

``ema.apply(var_list)`` inside ``control_dependencies([tx])`` returns ``tx`` with the
averages of ``var_list`` in its state: the parameters' taken in its update, the statistics'
(``batch_stats/BatchNorm_0/mean``, TF's ``moving_mean``) right after it in the same step
(``engine/averages.py``). JAX orders work by data, not by control edges, so the control
input is how the TF program names the optimizer the averages follow.

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

import contextlib
import contextvars
import numbers
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ..core import context
from ..core.errors import EstimatorTypeError, EstimatorValueError
from ..engine import averages, multi_loss
from ..io import variables as variables_lib
from . import trainable

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
        self._stat_names: list[str] = []  # the statistics ema.apply(var_list) averages
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

    def apply(self, var_list: Any = None) -> optax.GradientTransformation:
        """The train_op that also keeps moving averages.

        Two forms:

        - ``ema.apply(tx)``, ``tx`` an optax transformation: ``tx`` whose state also keeps the
          moving average of every parameter it updates.
        - ``ema.apply(var_list)`` (TF's form) inside model_fn, within
          ``with estimator.control_dependencies([tx]):``: ``tx`` whose state keeps the
          averages of the variables in ``var_list`` (``trainable_variables()`` entries,
          ``global_variables()`` / ``get_collection("moving_vars")`` ones for BatchNorm's
          statistics, or names); None means every trainable variable, as in TF.

        Raises:
          TypeError: neither a transformation nor a list of variables.
          ValueError: ``var_list`` outside ``control_dependencies([tx])`` (or with several
            transformations there), outside model_fn, or naming no variable of the model.
        """
        if hasattr(var_list, "init") and hasattr(var_list, "update"):
            return self._apply_optimizer(var_list)
        if var_list is None or (
            isinstance(var_list, Iterable) and not isinstance(var_list, (str, bytes, Mapping))
        ):
            return self._apply_variables(var_list)
        raise EstimatorTypeError(
            "ExponentialMovingAverage.apply takes an optax GradientTransformation or a list of "
            f"variables, got {type(var_list).__name__}"
        )

    def _apply_optimizer(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
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
            _check_update(state, params, MovingAverageState)
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

    def _apply_variables(self, var_list: Any) -> optax.GradientTransformation:
        """TF's ``ema.apply(var_list)`` after ``control_dependencies([tx])``: ``tx`` whose
        state (``averages.VariablesAverageState``) keeps the averages of ``var_list``."""
        tx = _control_optimizer()
        param_names, stats = _chosen(var_list)
        collections = sorted({n.split("/", 1)[0] for n in stats})
        # TF's initial values (a BatchNorm's variance starts at 1); the first update starts
        # each statistic's average from its value before it (averages.average_collections)
        fills = {
            n: (tuple(v.shape), v.dtype, float("moving_variance" in v.name))
            for n, v in stats.items()
        }
        self._stat_names = list(stats)

        def init(params):
            named = variables_lib.named_variables(params)
            clash = sorted({n.split("/", 1)[0] for n in named} & set(collections))
            if clash:
                raise EstimatorValueError(
                    f"ema.apply(var_list): a module is named like the collection {clash[0]!r}; "
                    "rename it (the averages of both are named by those names)"
                )
            if hasattr(params, "keys") or isinstance(params, (list, tuple)):  # not optax's
                self._names = list(named)  # placeholder (zero.optimizer_specs)
            shadow = {n: _copy(x) for n, x in named.items() if n in param_names}
            shadow.update({n: jnp.full(s, fill, d) for n, (s, d, fill) in fills.items()})
            return averages.VariablesAverageState(
                inner_state=tx.init(params),
                num_updates=jnp.zeros((), jnp.int32),
                use_for_eval=jnp.asarray(int(self.use_for_eval), jnp.int32),
                decay=jnp.zeros((), jnp.float32),
                ExponentialMovingAverage=averages.nest(shadow),
            )

        def update(updates, state, params=None, **extra):
            _check_update(state, params, averages.VariablesAverageState)
            inner = optax.with_extra_args_support(tx)
            updates, inner_state = inner.update(updates, state.inner_state, params, **extra)
            count = state.num_updates + 1
            decay = self.decay_at(count)
            new = variables_lib.named_variables(optax.apply_updates(params, updates))
            shadow = dict(state.ExponentialMovingAverage)
            kept = {c: shadow.pop(c) for c in collections if c in shadow}  # after the step
            averaged = {
                n: averages.blend(decay, s, new[n])
                for n, s in variables_lib.named_variables(shadow).items()
            }
            flag = jnp.asarray(int(self.use_for_eval), jnp.int32)
            shadow = {**averages.nest(averaged), **kept}
            return updates, averages.VariablesAverageState(inner_state, count, flag, decay, shadow)

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
            dict, or a list of names (``ema_vars``). None: TF's ``tf.trainable_variables()``
            plus the variables ``apply(var_list)`` averaged (TF's moving-average variables):
            inside model_fn, the model's ``params``; elsewhere (scaffold_fn), those of the
            model_fn call this EMA was made in, else the params it was applied to, else those
            of the model_fn traced last.

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
        if moving_avg_variables is None:
            names = [*names, *(n for n in self._stat_names if n not in names)]
        return {self.average_name(n): n for n in names}


def _check_update(state: Any, params: Any, kind: type) -> None:
    if params is None:
        raise EstimatorValueError(
            "ExponentialMovingAverage.apply(tx).update needs params (the estimator "
            "passes them; call tx.update(grads, state, params))"
        )
    if not isinstance(state, kind):
        raise EstimatorTypeError(f"expected a {kind.__name__}, got {type(state).__name__}")


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


# ------------------------------------------------------------------ TF's control-dependency form
_CONTROL: contextvars.ContextVar[tuple] = contextvars.ContextVar("control_inputs", default=())


def _is_transformation(x: Any) -> bool:
    return hasattr(x, "init") and hasattr(x, "update")


@contextlib.contextmanager
def control_dependencies(control_inputs: Any) -> Iterator[None]:
    """TF's ``tf.control_dependencies`` inside model_fn: what the block runs after.

    JAX orders computations by their data, so most control inputs have nothing to order: a
    train step already applies BatchNorm's updates (TF's ``UPDATE_OPS``) before the
    optimizer, and arrays are ignored. The one that matters is an optimizer (an optax
    transformation, ``estimator.group(...)``): ``ema.apply(var_list)`` inside the block
    returns it with the moving averages taken after its update, TF's EMA form::

        with estimator.control_dependencies([train_op]):
            train_op = ema.apply(ema_vars)

    Args:
      control_inputs: a list of train_ops, arrays or anything TF took; None clears the
        enclosing blocks' inputs, as in TF.

    Example:
      >>> with estimator.control_dependencies(estimator.get_collection("update_ops")):
      ...     train_op = optimizer  # TF: optimizer.minimize(loss, global_step)
    """
    if control_inputs is None:
        inputs: tuple = ()
    elif _is_transformation(control_inputs):
        inputs = (*_CONTROL.get(), control_inputs)
    else:
        inputs = (*_CONTROL.get(), *control_inputs)
    token = _CONTROL.set(inputs)
    try:
        yield
    finally:
        _CONTROL.reset(token)


def _control_optimizer() -> optax.GradientTransformation:
    """The optimizer ``ema.apply(var_list)`` follows: the one transformation among the
    control inputs of the enclosing ``control_dependencies`` blocks."""
    found = [x for x in _CONTROL.get() if _is_transformation(x)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise EstimatorValueError(
            "ExponentialMovingAverage.apply(var_list) averages the variables after the "
            "optimizer's update: call it as TF did, inside `with estimator.control_dependencies("
            "[train_op]):` where train_op is the optax optimizer, or wrap the optimizer "
            "itself: train_op = ema.apply(optimizer)"
        )
    raise EstimatorValueError(
        f"ExponentialMovingAverage.apply(var_list): control_dependencies holds {len(found)} "
        "optimizers; the averages follow one train_op (join several with estimator.group)"
    )


def _chosen(var_list: Any) -> tuple[set[str], dict[str, trainable.Variable]]:
    """``var_list`` resolved in the running model_fn: (the chosen parameters' names, the
    chosen non-parameter variables by name). None: every trainable variable (TF)."""
    if context.current() is None or context.current_root_module() is None:
        raise EstimatorValueError(
            "ExponentialMovingAverage.apply(var_list) must be called inside model_fn (the "
            "variables are the model's); outside it, use ema.apply(optimizer)"
        )
    every = {_var_name(v): v for v in trainable.global_variables()}
    params = {_var_name(v) for v in trainable.trainable_variables()}
    wanted = params if var_list is None else {_var_name(v) for v in var_list}
    unknown = sorted(wanted - set(every))
    if unknown:
        raise EstimatorValueError(
            f"ema.apply(var_list): the model has no variable named {unknown[0]!r} (its "
            f"variables: {', '.join(sorted(every)[:8])}{', ...' if len(every) > 8 else ''})"
        )
    return wanted & params, {n: every[n] for n in sorted(wanted - params)}


__all__ = ["ExponentialMovingAverage", "MovingAverageState", "control_dependencies"]
