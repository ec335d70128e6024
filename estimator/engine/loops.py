"""The compiled device loops: pure functions of explicit state, one XLA program per loop.

Every loop is ``jit(shard_map(scan(step)))``: manual over the ``"data"`` axis (model_fn runs
once per replica on its rows), with the ``"model"`` axis left to the compiler. A loop of ``n``
steps takes batches stacked ``[n, global_batch, ...]`` and returns per-step outputs stacked
the same way, so nothing crosses to the host inside the loop.

Gradients follow the pattern from the JAX notes: params are cast to replica-varying before
``grad`` and the gradient is ``pmean``-ed, which gives exactly the global-batch mean (the
implicit psum of a replicated parameter's gradient is what silently gives R times the
gradient otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ..parallel.mesh import DATA
from ..parallel.replica_context import is_varying
from ..spec import ModeKeys, TPUEstimatorSpec
from .model import ModelFn, step_rngs


class TrainState(NamedTuple):
    """Everything training changes. Replicated over ``"data"``."""

    params: Any
    state: dict  # every non-params collection (batch_stats, ...)
    opt_state: Any
    step: jax.Array  # int32 global step
    rng: jax.Array  # uint32 raw key data of the base key
    nonfinite: jax.Array  # int32 count of skipped non-finite steps


class SpecHolder(dict):
    """The spec model_fn returned, per mode, recorded while a loop was traced.

    It holds the whole spec (traced values included): read its static parts (train_op,
    host_call and metric functions, hooks, scaffold_fn, dtypes), never its traced values.
    """


def host_tensors(value: Any) -> Any:
    """The ``tensors`` half of an ``(fn, tensors)`` pair, as a pytree (None when absent)."""
    if value is None:
        return None
    tensors = value[1]
    return dict(tensors) if isinstance(tensors, Mapping) else list(tensors)


def replica_mean(tree: Any) -> Any:
    """Averages float leaves over replicas (ints take the max) so state stays replicated."""

    def one(x):
        if not is_varying(x, DATA):
            return x
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return lax.pmean(x, DATA)
        return lax.pmax(x, DATA)

    return jax.tree.map(one, tree)


def mean_gradients(grads: Any) -> Any:
    """``pmean`` of the gradients over replicas; on CPU, low-precision ones in float32.

    XLA:CPU aborts compiling the train loop (``Invalid binary instruction opcode copy``) when
    bfloat16 gradients are averaged over more than one device; float32 avoids it (and sums
    the replicas' gradients more exactly).
    """
    if jax.default_backend() != "cpu":
        return lax.pmean(grads, DATA)

    def one(g):
        if jnp.issubdtype(g.dtype, jnp.floating) and jnp.finfo(g.dtype).bits < 32:
            return lax.pmean(g.astype(jnp.float32), DATA).astype(g.dtype)
        return lax.pmean(g, DATA)

    return jax.tree.map(one, grads)


def _scalar_loss(spec: TPUEstimatorSpec) -> jax.Array:
    return jnp.reshape(spec.loss, ()).astype(jnp.float32)


def _variables(params: Any, state: dict) -> dict:
    return {"params": params, **state}


def _scan(step_fn, carry, xs, unroll: bool):
    # unroll=0 unrolls fully even for n=1 (unroll=n or True still emits a while loop then).
    return lax.scan(step_fn, carry, xs, unroll=0 if unroll else 1)


def constrain(tree: Any, specs: Any) -> Any:
    """Sharding constraints over the ``"model"`` axis inside a replica (None: no constraint).

    ``specs`` is a PartitionSpec for every leaf, or a pytree of them (a prefix of ``tree``).
    """
    if specs is None or tree is None:
        return tree
    if isinstance(specs, P):
        return jax.tree.map(lambda a: lax.with_sharding_constraint(a, specs), tree)
    return jax.tree.map(
        lambda s, a: (
            a if s is None else jax.tree.map(lambda x: lax.with_sharding_constraint(x, s), a)
        ),
        specs,
        tree,
        is_leaf=lambda s: s is None or isinstance(s, P),
    )


def make_train_loop(
    model: ModelFn,
    mesh: Mesh,
    holder: SpecHolder,
    *,
    batch_size: int,
    unroll: bool = False,
    skip_nonfinite: bool = False,
    var_specs: Any = None,
    input_specs: tuple = (None, None),
):
    """``loop(state, batch) -> (state, (loss[n], host_tensors[n, ...]))``, state donated.

    ``var_specs`` ({"params": ..., collection: ...} of PartitionSpecs) keeps variables sharded
    over ``"model"``; ``input_specs`` (features, labels) splits inputs spatially.
    """
    param_specs = None if var_specs is None else var_specs.get("params")
    state_specs = (
        None if var_specs is None else {k: v for k, v in var_specs.items() if k != "params"}
    )

    def step_fn(state: TrainState, batch: tuple):
        features, labels = constrain(batch[0], input_specs[0]), constrain(batch[1], input_specs[1])
        rngs = step_rngs(jax.random.wrap_key_data(state.rng), state.step, lax.axis_index(DATA))
        mask = jnp.ones((batch_size,), jnp.float32)
        mutable = tuple(state.state)

        def loss_fn(params):
            spec, new_state = model.apply(
                _variables(params, state.state),
                features,
                labels,
                mode=ModeKeys.TRAIN,
                batch_size=batch_size,
                mask=mask,
                step=state.step,
                rngs=rngs,
                mutable=mutable,
            )
            holder[ModeKeys.TRAIN] = spec
            return _scalar_loss(spec), (new_state, host_tensors(spec.host_call))

        varying = jax.tree.map(lambda a: lax.pcast(a, DATA, to="varying"), state.params)
        (loss, (new_state, host)), grads = jax.value_and_grad(loss_fn, has_aux=True)(varying)
        grads = mean_gradients(grads)
        loss = lax.pmean(loss, DATA)
        tx = holder[ModeKeys.TRAIN].train_op
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = constrain(optax.apply_updates(state.params, updates), param_specs)
        new_state = constrain(replica_mean(new_state), state_specs or None)
        new = TrainState(params, new_state, opt_state, state.step + 1, state.rng, state.nonfinite)
        if skip_nonfinite:
            finite = jnp.isfinite(loss) & jnp.all(
                jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)] or [True])
            )
            kept = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)
            new = kept._replace(step=state.step + 1, nonfinite=state.nonfinite + (~finite))
        return new, (loss, host)

    def loop(state: TrainState, features, labels):
        return _scan(step_fn, state, (features, labels), unroll)

    sharded = jax.shard_map(
        loop,
        mesh=mesh,
        in_specs=(P(), P(None, DATA), P(None, DATA)),
        out_specs=(P(), (P(), P(None, DATA))),
        axis_names={DATA},
    )
    return jax.jit(sharded, donate_argnums=0)


def make_eval_loop(
    model: ModelFn,
    mesh: Mesh,
    holder: SpecHolder,
    *,
    mode: str,
    batch_size: int,
    unroll: bool = False,
    input_specs: tuple = (None, None),
):
    """EVAL: ``loop(variables, step, rng, batch) -> (loss[n, R], metric tensors[n, GB, ...])``.

    PREDICT: the same signature returning ``predictions[n, GB, ...]``.
    """

    def step_fn(carry, batch):
        variables, step, rng = carry
        features, labels, mask = batch
        features, labels = constrain(features, input_specs[0]), constrain(labels, input_specs[1])
        rngs = step_rngs(jax.random.wrap_key_data(rng), step, lax.axis_index(DATA))
        spec, _ = model.apply(
            variables,
            features,
            labels,
            mode=mode,
            batch_size=batch_size,
            mask=mask,
            step=step,
            rngs=rngs,
        )
        holder[mode] = spec
        if mode == ModeKeys.PREDICT:
            return carry, spec.predictions
        return carry, (jnp.reshape(_scalar_loss(spec), (1,)), host_tensors(spec.eval_metrics))

    def loop(variables, step, rng, features, labels, mask):
        _, outs = _scan(step_fn, (variables, step, rng), (features, labels, mask), unroll)
        return outs

    sharded = jax.shard_map(
        loop,
        mesh=mesh,
        in_specs=(P(), P(), P(), P(None, DATA), P(None, DATA), P(None, DATA)),
        out_specs=P(None, DATA),
        axis_names={DATA},
    )
    return jax.jit(sharded)


def make_init(model: ModelFn, mesh: Mesh, holder: SpecHolder, *, mode: str, batch_size: int):
    """``init(rng, step, features, labels) -> variables`` for one replica's batch shape.

    Runs under the same shard_map as the loops so modules that use the ``"data"`` axis (e.g.
    cross-replica BatchNorm) initialise as they will run.
    """

    def init(rng, step, features, labels):
        key = jax.random.wrap_key_data(rng)
        rngs = step_rngs(key, step, 0)
        mask = jnp.ones((batch_size,), jnp.float32)
        variables, spec = model.init(
            rngs, features, labels, mode=mode, batch_size=batch_size, mask=mask, step=step
        )
        holder[mode] = spec
        # Flax partitioning boxes (nn.with_partitioning) stay: the estimator reads them to
        # shard variables over "model", then unboxes.
        return replica_mean(dict(variables))

    return jax.jit(
        jax.shard_map(
            init,
            mesh=mesh,
            in_specs=(P(), P(), P(DATA), P(DATA)),
            out_specs=P(),
            axis_names={DATA},
        )
    )
