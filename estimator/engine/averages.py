"""The state of ``ExponentialMovingAverage.apply(var_list)`` and its step after the model's.

TF's EfficientNet and MnasNet average the trainable variables and BatchNorm's moving
statistics::

    with tf.control_dependencies([train_op]):
      train_op = ema.apply(ema_vars)

The parameters' averages are taken inside the optimizer's update (``moving_average.py``),
which sees the new parameters. The statistics are not parameters: the step computes them
beside the gradient, so their averages are taken by ``average_collections``, called once by
the train step (``loops.py``) after the optimizer, with the collections before and after the
step. Both use the decay the optimizer's update computed (``decay``), so parameters and
statistics move by the same rule.

The shadow is one ``{name: array}`` tree named as the variables are (``io/variables.py``):
``dense/kernel`` for a parameter, ``batch_stats/BatchNorm_0/mean`` for a statistic. Checkpoints
therefore name each average ``<variable>/ExponentialMovingAverage`` (TF's names), and
evaluation with the averages (``use_for_eval`` or ``variables_to_restore``) finds every
one by the variable's name.

Example:
  >>> opt_state = average_collections(opt_state, state.state, new_state)  # in the train step
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class VariablesAverageState(NamedTuple):
    """The state of ``ExponentialMovingAverage.apply(var_list)``.

    The field ``ExponentialMovingAverage`` is the shadow: nested dicts of the averaged
    variables, parameters by their module path and every other collection's variables under
    the collection's name (``{"dense": {"kernel": ...}, "batch_stats": {...}}``); its name is
    what checkpoints' naming rule looks for (``io/variables.moving_average_names``).
    """

    inner_state: Any
    num_updates: jax.Array  # int32: updates applied so far
    use_for_eval: jax.Array  # int32 0/1: evaluate/predict/export read the shadow
    decay: jax.Array  # float32: the decay of the last update (average_collections reads it)
    ExponentialMovingAverage: Any  # noqa: N815 - TF's name, which checkpoints show


def nest(named: Mapping[str, Any]) -> dict:
    """``{"a/b": x}`` as ``{"a": {"b": x}}`` (the inverse of ``io/variables.named_variables``)."""
    out: dict = {}
    for name, value in named.items():
        *parents, leaf = name.split("/")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def _named(tree: Any) -> dict[str, Any]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key(k) for k in path): x for path, x in flat}


def _key(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def blend(decay: jax.Array, shadow: jax.Array, value: jax.Array) -> jax.Array:
    """``decay * shadow + (1 - decay) * value`` in the shadow's dtype (the convex form: decay
    0 gives ``value`` and decay 1 ``shadow`` exactly)."""
    return (decay * shadow + (1.0 - decay) * value).astype(shadow.dtype)


def _average(state: VariablesAverageState, old: Mapping, new: Mapping) -> VariablesAverageState:
    shadow = dict(state.ExponentialMovingAverage)
    first = state.num_updates == 1  # the first update: the statistics before it start the shadow
    for collection in [c for c in shadow if c in new]:
        before, after = _named(old.get(collection, {})), _named(new[collection])
        averaged = {}
        for name, s in _named(shadow[collection]).items():
            previous = jnp.where(first, before[name].astype(s.dtype), s) if name in before else s
            averaged[name] = blend(state.decay, previous, after[name])
        shadow[collection] = nest(averaged)
    return state._replace(ExponentialMovingAverage=shadow)


def average_collections(opt_state: Any, old: Mapping, new: Mapping) -> Any:
    """``opt_state`` with the averages of the non-parameter variables (BatchNorm statistics)
    that an ``ExponentialMovingAverage.apply(var_list)`` chose moved toward ``new``.

    Called once per train step, after the optimizer's update (which counted the update and
    set its ``decay``). The first update starts each average from ``old`` (the statistics as
    they were before the step: TF's initial value, or a warm start's), then averages in
    ``new``. Any other optimizer state is returned unchanged (no work for it).

    Args:
      opt_state: the optimizer state after the update.
      old: the step's non-parameter collections before the step (``{"batch_stats": ...}``).
      new: the same collections after it (already agreed over replicas).
    """

    def one(node: Any) -> Any:
        return _average(node, old, new) if isinstance(node, VariablesAverageState) else node

    if not new:
        return opt_state
    return jax.tree.map(one, opt_state, is_leaf=lambda n: isinstance(n, VariablesAverageState))


__all__ = ["VariablesAverageState", "average_collections", "blend", "nest"]
