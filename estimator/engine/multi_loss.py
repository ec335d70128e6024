"""Several losses, each with its own optimizer over its own variables, in one train step.

TF trained a GAN (and actor-critic, two-tower models) with one train op built from pieces::

    d_step = d_optimizer.minimize(d_loss, var_list=<Discriminator variables>)
    g_step = g_optimizer.minimize(g_loss, var_list=<Generator variables>)
    train_op = tf.group(d_step, g_step)

Here the same lines read::

    d_step = estimator.minimize(d_loss, d_optimizer, var_list="Discriminator")
    g_step = estimator.minimize(g_loss, g_optimizer, var_list="Generator")
    train_op = estimator.group(d_step, g_step)

``minimize`` names a loss, an optax optimizer and the variables it trains; ``group`` joins
them into one ``train_op`` (a ``TrainOp``, itself an optax transformation). Each step, every
loss is differentiated with respect to its own variables only (the other variables are
constants for it, TF's semantics), all gradients are taken at the step's starting weights,
averaged over replicas as usual, and each optimizer updates its own variables; variables no
``var_list`` names are not trained (as in TF), and ``global_step`` advances once. The spec's
``loss`` is what logs, hooks and evaluation report (DCGAN reports ``g_loss``).

``var_list`` is None (every trainable variable), a string (a regular expression matched at
the start of each name, TF's ``scope=`` rule: ``"Discriminator"`` selects
``Discriminator/d_conv1/kernel``), a list of strings and ``estimator.trainable_variables()``
entries (a Variable selects exactly itself), or an optax mask function of the params
(``estimator.name_mask(...)``). Two ``var_list`` s may not share a variable.

One forward pass computes every loss; each loss then has its own backward pass (the
computation of gradients the step does not use is dropped by the compiler). Everything else
about the step is unchanged, so a group works with ``compute_dtype="float16"`` (every loss
scaled by the one loss scale, the step skipped when any gradient overflows),
``num_microbatches`` (each loss's gradient accumulated), ``ExponentialMovingAverage.apply(
group)``, ``shard_optimizer_state`` and ``shard_params``; each optimizer's state is that of
``optax.multi_transform`` (checkpointed under ``opt_state``).

The silent case: the natural port of such a program to one loss, ``loss=g_loss`` with
``optax.chain(optax.masked(d_opt, d_mask), optax.masked(g_opt, g_mask))``, trains both
networks on ``g_loss``; ``masked_chain`` logs a WARNING for it that names the variable sets
and this way to write it. ``train_op=estimator.minimize(loss, optax.chain(...))`` says that
one loss for every optimizer of the chain is intended: no warning then.

Example:
  >>> def model_fn(features, labels, mode, params):
  ...     fake = generator(features["random_noise"])
  ...     d_real, d_fake = discriminator(labels), discriminator(fake)
  ...     d_loss, g_loss = ...
  ...     train_op = estimator.group(
  ...         estimator.minimize(d_loss, optax.adam(2e-4, b1=0.5), var_list="Discriminator"),
  ...         estimator.minimize(g_loss, optax.adam(2e-4, b1=0.5), var_list="Generator"))
  ...     return estimator.TPUEstimatorSpec(mode, loss=g_loss, train_op=train_op)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ..core import context
from ..core.errors import EstimatorTypeError, EstimatorValueError
from ..core.spec import ModeKeys
from . import masked_chain

#: The CallContext note that model_fn called ``minimize`` (see ``value_and_grad``).
NOTE = "minimize"
_FROZEN = "not_trained"  # the label of variables no var_list names


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_names(params: Any) -> list[str]:
    """The variable names (``dense/kernel``) of ``params``' leaves, in leaf order."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return ["/".join(_key_name(k) for k in path) for path, _ in flat]


def _strip(name: str) -> str:
    return re.sub(r":\d+$", "", name)  # TF's ":0" output suffix


class _Selector(NamedTuple):
    """A ``var_list``, resolved to what selects a variable."""

    text: str  # for messages
    patterns: tuple[re.Pattern, ...] = ()
    names: frozenset = frozenset()
    mask_fn: Callable | None = None
    everything: bool = False

    def select(self, params: Any) -> list[bool]:
        """One bool per leaf of ``params``: whether this var_list names it."""
        if self.everything:
            return [True] * len(jax.tree.leaves(params))
        if self.mask_fn is not None:
            mask = self.mask_fn(params)
            # a prefix mask ({"Discriminator": True, ...}) covers the subtree below it
            full = jax.tree.map(lambda m, p: jax.tree.map(lambda _: bool(m), p), mask, params)
            return [bool(m) for m in jax.tree.leaves(full)]
        return [
            n in self.names or any(p.match(n) for p in self.patterns) for n in leaf_names(params)
        ]


def _selector(var_list: Any) -> _Selector:
    if var_list is None:
        return _Selector("every variable", everything=True)
    if isinstance(var_list, str):
        return _Selector(repr(var_list), patterns=(re.compile(_strip(var_list)),))
    if callable(var_list) and not hasattr(var_list, "name"):
        return _Selector(getattr(var_list, "__name__", "a mask function"), mask_fn=var_list)
    if not isinstance(var_list, Iterable) or isinstance(var_list, Mapping | bytes):
        raise EstimatorTypeError(
            "minimize(var_list=...) takes None, a name pattern, a list of names and "
            "estimator.trainable_variables() entries, or an optax mask function; got "
            f"{type(var_list).__name__}"
        )
    patterns, names = [], set()
    for v in var_list:
        if isinstance(v, str) and hasattr(v, "aliases"):  # a Variable's .name: itself
            names.add(_strip(v))
        elif isinstance(v, str):
            patterns.append(re.compile(_strip(v)))
        elif isinstance(getattr(v, "name", None), str):  # a trainable_variables() entry
            names.add(_strip(v.name))
        else:
            raise EstimatorTypeError(
                "minimize(var_list=[...]) entries must be name patterns (str) or "
                f"estimator.trainable_variables() entries; got {v!r}"
            )
    shown = [p.pattern for p in patterns] + sorted(names)
    text = ", ".join(shown[:3]) + (f", ... ({len(shown)} entries)" if len(shown) > 3 else "")
    return _Selector(f"[{text}]", tuple(patterns), frozenset(names))


class Minimize(NamedTuple):
    """One ``minimize(loss, optimizer, var_list=...)`` of a ``TrainOp``."""

    loss: Any  # the traced loss of this call of model_fn
    optimizer: optax.GradientTransformation
    selector: _Selector


class TrainOp(optax.GradientTransformationExtraArgs):
    """The train_op ``minimize`` and ``group`` return: an optax transformation (each term's
    optimizer on its own variables, zero updates for the rest) whose ``terms`` are the
    ``Minimize`` s the estimator differentiates, one loss each."""

    terms: tuple[Minimize, ...]


def terms_of(train_op: Any) -> tuple[Minimize, ...]:
    """The ``Minimize`` terms of a train_op (empty for a plain optax transformation)."""
    return tuple(getattr(train_op, "terms", ())) if isinstance(train_op, TrainOp) else ()


def owners(terms: tuple[Minimize, ...], params: Any) -> Any:
    """A tree like ``params`` holding, per variable, the index of the term that trains it
    (-1: none).

    Raises:
      ValueError: a var_list selects no variable, or two select the same one.
    """
    names = leaf_names(params)
    owner = [-1] * len(names)
    for i, term in enumerate(terms):
        chosen = term.selector.select(params)
        if not any(chosen):
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise EstimatorValueError(
                f"minimize #{i} (var_list={term.selector.text}) selects no variable (TF: 'No "
                f"variables to optimize'); the model's variables are: {shown}"
            )
        shared = [n for n, c, o in zip(names, chosen, owner) if c and o >= 0]
        if shared:
            raise EstimatorValueError(
                f"minimize #{i} (var_list={term.selector.text}) and an earlier minimize both "
                f"train {', '.join(shared[:4])}{' ...' if len(shared) > 4 else ''}: each "
                "variable may be trained by one minimize of a group"
            )
        owner = [i if c else o for c, o in zip(chosen, owner)]
    return jax.tree.unflatten(jax.tree.structure(params), owner)


def _train_op(terms: tuple[Minimize, ...]) -> TrainOp:
    transforms = {str(i): t.optimizer for i, t in enumerate(terms)}
    transforms[_FROZEN] = optax.set_to_zero()

    def labels(params):
        return jax.tree.map(lambda o: _FROZEN if o < 0 else str(o), owners(terms, params))

    inner = optax.multi_transform(transforms, labels)
    op = TrainOp(inner.init, inner.update)
    op.terms = terms
    return op


def minimize(
    loss: Any,
    optimizer: optax.GradientTransformation,
    *,
    var_list: Any = None,
    global_step: Any = None,
    name: str | None = None,
) -> TrainOp:
    """TF's ``optimizer.minimize(loss, var_list=...)``: train ``var_list`` on ``loss``.

    A train_op by itself (``train_op=estimator.minimize(loss, tx)``, the same as
    ``train_op=tx`` when ``loss`` is the spec's loss), or one piece of ``group``.

    Args:
      loss: a scalar computed in this call of model_fn.
      optimizer: an optax GradientTransformation (``CrossShardOptimizer`` too).
      var_list: keyword-only; the variables to train (None: all of them); see the module
        docstring for the forms.
      global_step: keyword-only, TF's argument; ignored: the estimator advances the global
        step once per step.
      name: keyword-only, TF's argument; ignored.

    Example:
      >>> d_step = estimator.minimize(d_loss, optax.adam(2e-4), var_list="Discriminator")
    """
    del global_step, name
    if not isinstance(optimizer, optax.GradientTransformation):
        raise EstimatorTypeError(
            "minimize(loss, optimizer): optimizer must be an optax GradientTransformation "
            f"(e.g. optax.adam(1e-3)), got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, TrainOp):
        raise EstimatorTypeError("minimize(loss, optimizer): optimizer is already a train op")
    ctx = context.current()
    if ctx is not None:  # read by value_and_grad: a train op lost inside another transform
        ctx.notes[NOTE] = True
    return _train_op((Minimize(loss, optimizer, _selector(var_list)),))


def group(*train_ops: Any, name: str | None = None) -> TrainOp:
    """TF's ``tf.group(...)`` of ``minimize`` train ops: one train_op running all of them.

    Args:
      *train_ops: ``minimize(...)`` results, or lists of them (``tf.group([a, b])``).
      name: keyword-only, TF's argument; ignored.

    Raises:
      TypeError: an entry is not a ``minimize`` train op (TF's
        ``tf.assign_add(global_step, 1)`` is dropped: the estimator advances the step).

    Example:
      >>> train_op = estimator.group(d_step, g_step)
    """
    del name
    terms: list[Minimize] = []
    stack = list(train_ops)
    while stack:
        op = stack.pop(0)
        if isinstance(op, list | tuple) and not isinstance(op, optax.GradientTransformation):
            stack[:0] = list(op)
        elif isinstance(op, TrainOp):
            terms.extend(terms_of(op))
        else:
            raise EstimatorTypeError(
                "estimator.group takes estimator.minimize(...) train ops, got "
                f"{type(op).__name__}. The estimator advances global_step once per step "
                "itself: drop TF's increment_step = tf.assign_add(global_step, 1) from the group"
            )
    if not terms:
        raise EstimatorValueError("estimator.group() needs at least one minimize(...)")
    return _train_op(tuple(terms))


def with_terms(like: Any, tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` (a wrapper of ``like``, e.g. ``ExponentialMovingAverage.apply``) as a
    ``TrainOp`` carrying ``like``'s terms when ``like`` is one; ``tx`` otherwise."""
    terms = terms_of(like)
    if not terms:
        return tx
    extra = optax.with_extra_args_support(tx)
    op = TrainOp(extra.init, extra.update)
    op.terms = terms
    return op


def _scalar(loss: Any, i: int) -> jax.Array:
    loss = jnp.asarray(loss)
    if loss.size != 1:
        raise EstimatorValueError(
            f"minimize #{i}: the loss must be a scalar, got shape {tuple(loss.shape)}"
        )
    return jnp.reshape(loss, ()).astype(jnp.float32)


def objective(spec: Any, loss: jax.Array) -> jax.Array:
    """What the train step differentiates: ``loss`` (the spec's), or the ``[terms]`` vector
    of a ``TrainOp``'s losses."""
    terms = terms_of(spec.train_op)
    if not terms:
        return loss
    return jnp.stack([_scalar(t.loss, i) for i, t in enumerate(terms)])


def _unit(out: jax.Array, i: int) -> jax.Array:
    # zeros_like keeps ``out``'s replica-varying type, which the cotangent must match
    return jnp.zeros_like(out).at[i].set(1)


def value_and_grad(loss_fn: Callable, holder: Mapping, model: Any) -> Callable:
    """``jax.value_and_grad(loss_fn, has_aux=True)`` that routes a ``TrainOp``'s losses.

    ``loss_fn(params) -> (objective, aux)`` records model_fn's spec in ``holder`` while it is
    traced. For a plain train_op, the gradient of the scalar objective (what
    ``jax.value_and_grad`` computes). For a ``TrainOp``, one forward pass and one backward
    pass per loss: each variable's gradient is that of the loss whose ``var_list`` names it
    (zero for variables no term trains). ``model`` (the ``ModelFn``) tells whether model_fn
    called ``minimize``.

    Raises:
      ValueError: model_fn built a train op with ``minimize``/``group`` but returned it
        wrapped in another transformation, which would lose its losses.
    """

    def run(params):
        out, vjp_fn, aux = jax.vjp(loss_fn, params, has_aux=True)
        train_op = holder[ModeKeys.TRAIN].train_op
        terms = terms_of(train_op)
        if not terms:
            if model.noted(ModeKeys.TRAIN, NOTE):
                raise EstimatorValueError(
                    "model_fn built a train op with estimator.minimize/group but returned "
                    "another train_op (a wrapper of it?), which trains every variable on the "
                    "spec's loss: return the group itself (ExponentialMovingAverage.apply("
                    "group) keeps its losses), or optax transformations only"
                )
            masked_chain.warn(train_op, params)
            (grads,) = vjp_fn(jnp.ones_like(out))
            return (out, aux), grads
        owner = jax.tree.leaves(owners(terms, params))
        per_term = [jax.tree.leaves(vjp_fn(_unit(out, i))[0]) for i in range(len(terms))]
        leaves = [
            per_term[o][j] if o >= 0 else jnp.zeros_like(per_term[0][j])
            for j, o in enumerate(owner)
        ]
        return (out, aux), jax.tree.unflatten(jax.tree.structure(params), leaves)

    return run


__all__ = ["Minimize", "TrainOp", "group", "minimize"]
