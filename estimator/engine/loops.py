"""The compiled device loops: pure functions of explicit state, one XLA program per loop.

Every loop is ``jit(shard_map(scan(step)))``: manual over the ``"data"`` axis (model_fn runs
once per replica on its rows), with the ``"model"`` axis left to the compiler. A loop of ``n``
steps takes batches stacked ``[n, global_batch, ...]`` and returns per-step outputs stacked
the same way, so nothing crosses to the host inside the loop.

The one exception is training with state split over replicas (``TPUConfig.shard_params`` /
``shard_optimizer_state``, docs/sharding.md): ``jit(scan(step))``, where each step's gradient
half is a ``shard_map`` and the optimizer half runs on arrays split over ``"data"``.

Gradients follow the pattern of docs/strategy.md ("The gradient trap"): params are cast to
replica-varying before ``grad`` and the gradient is ``pmean``-ed, which gives exactly the
global-batch mean (the implicit psum of a replicated parameter's gradient is what silently
gives R times the gradient otherwise).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ..core.spec import ModeKeys, TPUEstimatorSpec
from ..parallel import fsdp, zero
from ..parallel.mesh import DATA
from ..parallel.replica_context import is_varying
from . import averages, microbatch, multi_loss, precision
from .model import ModelFn, step_rngs
from .options import StepOptions


class TrainState(NamedTuple):
    """Everything training changes. Replicated over ``"data"``."""

    params: Any
    state: dict  # every non-params collection (batch_stats, ...)
    opt_state: Any
    step: jax.Array  # int32 global step
    rng: jax.Array  # uint32 raw key data of the base key
    nonfinite: jax.Array  # int32 count of skipped non-finite steps
    loss_scale: Any = None  # precision.LossScale with compute_dtype="float16", else None


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


def finite_flags(tree: Any) -> jax.Array:
    """``[leaves]`` bools, one per floating-point leaf of ``tree``: all its values finite.

    A leaf is checked through its sum (NaN and Inf propagate through it; accumulated in at
    least float32), a plain float reduction (cheaper on XLA:CPU than ``all(isfinite(x))``). A
    leaf whose finite values sum beyond float32's range (about 3e38) counts as non-finite.
    Agreed over ``"data"`` inside a ``shard_map`` (all replicas must be finite), so the
    result is replicated.
    """

    def finite(x):
        return jnp.isfinite(jnp.sum(x, dtype=jnp.promote_types(x.dtype, jnp.float32)))

    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    flags = jnp.stack([finite(x) for x in leaves]) if leaves else jnp.ones(0, bool)
    if is_varying(flags, DATA):
        flags = lax.pmin(flags.astype(jnp.int32), DATA) > 0
    return flags


def _state_flags(state: TrainState) -> jax.Array:
    return finite_flags((state.params, state.state, state.opt_state))


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


def _to_varying(a: jax.Array) -> jax.Array:
    # A slice split over "data" is already replica-varying; a replicated leaf is cast.
    return a if is_varying(a, DATA) else lax.pcast(a, DATA, to="varying")


def _update_fn(holder: SpecHolder, *, skip_nonfinite: bool):
    """The optimizer half of a train step (``_train_step_parts``): ``update(state, loss,
    grads, new_state, place)``; a non-finite step is skipped (and counted) when asked for or
    when the loss is scaled."""

    def update(state: TrainState, loss, grads, new_state, place) -> TrainState:
        tx = holder[ModeKeys.TRAIN].train_op
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        # ema.apply(var_list): the averages of BatchNorm statistics follow the new ones
        opt_state = averages.average_collections(opt_state, state.state, new_state)
        params, opt_state, new_state = place(
            optax.apply_updates(state.params, updates), opt_state, new_state
        )
        new = state._replace(
            params=params, state=new_state, opt_state=opt_state, step=state.step + 1
        )
        if skip_nonfinite or state.loss_scale is not None:
            # skipped if its loss, its gradient or the new state is not finite; so a state
            # that enters finite stays finite, and the per-call check needs no per-step flags
            finite = jnp.isfinite(loss) & jnp.all(finite_flags(grads)) & jnp.all(_state_flags(new))
            kept = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)
            new = kept._replace(step=state.step + 1, nonfinite=state.nonfinite + (~finite))
            if state.loss_scale is not None:
                new = new._replace(loss_scale=precision.next_loss_scale(state.loss_scale, finite))
        return new

    return update


def _train_step_parts(
    model: ModelFn, holder: SpecHolder, options: StepOptions, *, batch_size: int, input_specs: tuple
):
    """The two halves of a train step: ``gradients`` (one replica's rows, inside the
    ``shard_map`` over ``"data"``) and ``update`` (the optimizer step on reduced gradients).

    ``gradients(state, features, labels, *, view=None) -> (loss, grads, new_state, host)``
    returns the replica's own loss and gradient (replica-varying, not yet reduced) and its
    mutable collections; ``view`` (FSDP, ``zero.gather_params``) maps the replica's
    parameter slices to the whole parameters model_fn reads, gathered per use.
    ``update(state, loss, grads, new_state, place)`` applies the optimizer;
    ``place(params, opt_state, new_state)`` returns them with their shardings.

    ``options.policy`` runs model_fn on cast inputs and parameters (``precision``), with the
    loss scaled when it is float16; ``options.num_microbatches`` accumulates the gradient
    over that many micro-batches of the replica's rows (``microbatch``).
    """
    policy, num_microbatches = options.policy, options.num_microbatches
    rows = microbatch.micro_rows(batch_size, num_microbatches)

    def gradients(state: TrainState, features, labels, *, view=None):
        features, labels = constrain(features, input_specs[0]), constrain(labels, input_specs[1])
        key = jax.random.wrap_key_data(state.rng)
        varying = jax.tree.map(_to_varying, state.params)

        def one(collections, features, labels, micro):
            rngs = step_rngs(
                key if micro is None else jax.random.fold_in(key, micro),
                state.step,
                lax.axis_index(DATA),
            )

            def loss_fn(params):
                if view is not None:
                    params = view(params)
                variables, inputs = policy.to_compute(_variables(params, collections), features)
                spec, new_state = model.apply(
                    variables,
                    inputs,
                    labels,
                    mode=ModeKeys.TRAIN,
                    batch_size=rows,
                    mask=jnp.ones((rows,), jnp.float32),
                    step=state.step,
                    rngs=rngs,
                    mutable=tuple(collections),
                )
                holder[ModeKeys.TRAIN] = spec
                loss = _scalar_loss(spec)
                host, new_state = policy.from_compute(
                    host_tensors(spec.host_call), new_state, collections
                )
                objective = multi_loss.objective(spec, loss)  # a TrainOp: one loss per term
                return precision.scale_loss(objective, state.loss_scale), (loss, new_state, host)

            if view is not None:  # FSDP: each parameter gathered where it is used
                loss_fn = fsdp.gathered_at_use(loss_fn)
            grad_fn = multi_loss.value_and_grad(loss_fn, holder, model)
            (_, (loss, new, host)), grads = grad_fn(varying)
            return loss, grads, new, host

        loss, grads, new_state, host = microbatch.accumulate(
            one, state.state, state.params, features, labels, num_microbatches
        )
        return loss, precision.unscale(grads, state.loss_scale), new_state, host

    return gradients, _update_fn(holder, skip_nonfinite=options.skip_nonfinite)


def make_train_loop(
    model: ModelFn,
    mesh: Mesh,
    holder: SpecHolder,
    options: StepOptions,
    *,
    batch_size: int,
    var_specs: Any = None,
    input_specs: tuple = (None, None),
    per_step_flags: bool = True,
):
    """``loop(state, batch) -> (state, (loss[n], host_tensors[n, ...], finite))``: the train
    step as ``options`` (``engine/options.py``) says, its input state donated unless
    ``options.keeps_input(per_step_flags)``. ``finite`` flags every floating-point leaf of
    the params, collections and optimizer state (``finite_flags``): ``[leaves]`` of the state
    the call returns, or with ``per_step_flags`` ``[n, leaves]``, one row per step. The host
    checks it before any save (``driver/nonfinite.py``); the per-step form costs a pass over
    the whole state every step (docs/performance.md, finding 14), so it is kept for finding
    the step.

    ``var_specs`` ({"params": ..., collection: ...} of PartitionSpecs) keeps variables sharded
    over ``"model"``; ``input_specs`` (features, labels) splits inputs spatially. With
    ``options.sharded_state`` the state is sharded over ``"data"`` as well
    (``make_sharded_state_train_loop``).
    """
    param_specs = None if var_specs is None else var_specs.get("params")
    state_specs = (
        None if var_specs is None else {k: v for k, v in var_specs.items() if k != "params"}
    )
    gradients, update = _train_step_parts(
        model, holder, options, batch_size=batch_size, input_specs=input_specs
    )
    if options.sharded_state:
        return make_sharded_state_train_loop(
            gradients,
            update,
            mesh,
            holder,
            options,
            param_specs=param_specs,
            state_specs=state_specs,
            per_step_flags=per_step_flags,
        )

    def place(params, opt_state, new_state):
        return constrain(params, param_specs), opt_state, constrain(new_state, state_specs or None)

    def step_fn(state: TrainState, batch: tuple):
        loss, grads, new_state, host = gradients(state, *batch)
        grads = mean_gradients(grads)
        loss = lax.pmean(loss, DATA)
        new = update(state, loss, grads, replica_mean(new_state), place)
        return new, (loss, host, _state_flags(new) if per_step_flags else None)

    def loop(state: TrainState, features, labels):
        scanned = _scan(step_fn, state, (features, labels), options.unroll)
        return _final_flags(scanned, per_step_flags)

    sharded = jax.shard_map(
        loop,
        mesh=mesh,
        in_specs=(P(), P(None, DATA), P(None, DATA)),
        out_specs=(P(), (P(), P(None, DATA), P())),
        axis_names={DATA},
    )
    return jax.jit(sharded, donate_argnums=_donated(options, per_step_flags))


def _donated(options: StepOptions, per_step_flags: bool) -> tuple:
    """A train loop's ``donate_argnums``: the state, unless the program keeps it."""
    return () if options.keeps_input(per_step_flags) else (0,)


def _final_flags(scanned: tuple, per_step_flags: bool) -> tuple:
    """A train scan's ``(state, (loss, host, flags))``; without per-step flags, the flags of
    the state it ends with: one pass over the state per call, not per step."""
    new, (loss, host, flags) = scanned
    return new, (loss, host, flags if per_step_flags else _state_flags(new))


def make_sharded_state_train_loop(
    gradients,
    update,
    mesh: Mesh,
    holder: SpecHolder,
    options: StepOptions,
    *,
    param_specs: Any,
    state_specs: Any,
    per_step_flags: bool = True,
):
    """The train loop with optimizer state (and with ``options.sharded_params`` parameters)
    split over ``"data"`` (ZeRO-1/2/3; the layout rules are in ``zero``).

    ``jit(scan(step))``, each step: ``shard_map`` over ``"data"`` computes every replica's
    gradient and reduce-scatters it (each replica gets the global mean of its 1/R slice of
    every sharded leaf); the optimizer then runs outside the ``shard_map`` on arrays split
    over ``"data"``, so the compiler keeps each replica's update on its own slice and inserts
    the collectives that global reductions need (``clip_by_global_norm``'s norm is the norm of
    the whole gradient, exactly as replicated). Updated parameters are all-gathered (or, with
    ``shard_params``, stay split and are all-gathered on entry to the next step's forward).
    """

    replicas, shard_params = mesh.shape[DATA], options.sharded_params

    def step_fn(state: TrainState, batch: tuple):
        sharded = zero.param_specs(state.params, param_specs, num_replicas=replicas)
        scatter = jax.tree.map(zero.data_only, sharded, is_leaf=lambda x: isinstance(x, P))

        def replica(state, features, labels):
            if shard_params:  # FSDP: each leaf gathered where it is used, grads scattered
                view = functools.partial(zero.gather_params, specs=scatter)
                loss, grads, new_state, host = gradients(state, features, labels, view=view)
                grads = zero.scattered_mean(grads, scatter)
            else:
                loss, grads, new_state, host = gradients(state, features, labels)
                grads = zero.scatter_gradients(grads, scatter)
            return lax.pmean(loss, DATA), grads, replica_mean(new_state), host

        # Only what the forward pass reads enters the shard_map, parameters as they are at
        # rest (with shard_params, each replica's slices); the optimizer state stays outside.
        state_specs_in = TrainState(scatter if shard_params else P(), P(), P(), P(), P(), P())
        loss, grads, new_state, host = jax.shard_map(
            replica,
            mesh=mesh,
            in_specs=(state_specs_in, P(DATA), P(DATA)),
            out_specs=(P(), scatter, P(), P(DATA)),
            axis_names={DATA},
        )(state._replace(opt_state=None, nonfinite=None), *batch)
        tx = holder[ModeKeys.TRAIN].train_op
        opt_specs = zero.optimizer_specs(tx, state.opt_state, state.params, sharded)
        at_rest = sharded if shard_params else zero.resolved_model_specs(state.params, param_specs)

        def place(params, opt_state, new_state):
            return (
                zero.constrain(params, mesh, at_rest),
                zero.constrain(opt_state, mesh, opt_specs),
                zero.constrain(new_state, mesh, state_specs) if state_specs else new_state,
            )

        grads = zero.constrain(grads, mesh, sharded)
        new = update(state, loss, grads, new_state, place)
        return new, (loss, host, _state_flags(new) if per_step_flags else None)

    def loop(state: TrainState, features, labels):
        scanned = _scan(step_fn, state, (features, labels), options.unroll)
        return _final_flags(scanned, per_step_flags)

    return jax.jit(loop, donate_argnums=_donated(options, per_step_flags))


def make_eval_loop(
    model: ModelFn,
    mesh: Mesh,
    holder: SpecHolder,
    *,
    mode: str,
    batch_size: int,
    unroll: bool = False,
    input_specs: tuple = (None, None),
    policy: precision.Policy | None = None,
):
    """EVAL: ``loop(variables, step, rng, batch) -> (loss[n, R], metric tensors[n, GB, ...])``.

    PREDICT: the same signature returning ``predictions[n, GB, ...]``. ``policy`` (the
    step options' compute-dtype policy; None: float32) runs model_fn on cast inputs and
    parameters; what reaches the host is float32.
    """
    policy = precision.Policy() if policy is None else policy

    def step_fn(carry, batch):
        variables, step, rng = carry
        features, labels, mask = batch
        features, labels = constrain(features, input_specs[0]), constrain(labels, input_specs[1])
        rngs = step_rngs(jax.random.wrap_key_data(rng), step, lax.axis_index(DATA))
        variables, features = policy.to_compute(variables, features)
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
            return carry, policy.from_compute(spec.predictions)[0]
        metrics, _ = policy.from_compute(host_tensors(spec.eval_metrics))
        return carry, (jnp.reshape(_scalar_loss(spec), (1,)), metrics)

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
    """``init(rng, step, features, labels) -> variables`` from a chunk's first batch.

    ``features``/``labels`` are a chunk's stacked ``[n, global_batch, ...]`` arrays; step 0's
    batch is taken inside the program, so setting up runs no eager device operation. Runs under
    the same shard_map as the loops so modules that use the ``"data"`` axis (e.g.
    cross-replica BatchNorm) initialise as they will run.
    """

    def init(rng, step, features, labels):
        features, labels = jax.tree.map(lambda x: x[0], (features, labels))
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
            in_specs=(P(), P(), P(None, DATA), P(None, DATA)),
            out_specs=P(),
            axis_names={DATA},
        )
    )


def make_split_init(model: ModelFn, holder: SpecHolder, *, mode: str, batch_size: int):
    """``make_init``'s function without the ``shard_map``: for state split over replicas.

    Traced under plain ``jit`` with split ``out_shardings``, the compiler partitions the
    initializers (``jax_threefry_partitionable``), so each device draws only its own slices:
    inside ``make_init``'s ``shard_map`` every device draws the whole model, and the random
    number intermediates of the largest kernels made that program the peak of a sharded
    run (docs/sharding.md, "Memory"). It initialises from replica 0's rows, with replica 0's
    rngs, so the values are ``make_init``'s. A model_fn that uses the ``"data"`` axis while
    initialising cannot be traced here (the caller falls back to ``make_init``).
    """

    def init(rng, step, features, labels):
        features, labels = jax.tree.map(lambda x: x[0, :batch_size], (features, labels))
        rngs = step_rngs(jax.random.wrap_key_data(rng), step, 0)
        mask = jnp.ones((batch_size,), jnp.float32)
        variables, spec = model.init(
            rngs, features, labels, mode=mode, batch_size=batch_size, mask=mask, step=step
        )
        holder[mode] = spec
        return dict(variables)

    return init


def make_fresh_train_state(
    init,
    holder: SpecHolder,
    *,
    var_shardings: Any,
    replicated: Any,
    unbox,
    with_optimizer: bool = True,
    opt_shardings: Any = None,
    compiler_options: dict | None = None,
    drawn_params: Any = None,
    loss_scale: bool = False,
):
    """One program for a fresh start: ``state(rng, features, labels) -> (variables,
    opt_state, {"step", "rng", "nonfinite"[, "loss_scale"]})``, every output placed on the
    mesh (``loss_scale``: float16's initial ``precision.LossScale``).

    ``init`` is ``make_init``'s TRAIN program (already traced once, so this trace reuses it);
    ``var_shardings`` the variables' NamedShardings. ``opt_shardings`` (None: the compiler's
    choice, which gives slots their parameter's sharding) places the optimizer state.
    ``with_optimizer=False`` returns ``None`` for it (a scaffold may still replace variables).
    ``drawn_params`` (shardings split over replicas, with ``make_split_init``) lays the
    parameters out split where they are drawn, before ``var_shardings`` gathers them
    (ZeRO-1 keeps them whole): each device draws only its slices.
    """

    def fresh(rng, features, labels):
        step = jnp.zeros((), jnp.int32)
        variables = unbox(init(rng, step, features, labels))
        if drawn_params is not None and "params" in variables:
            drawn = jax.lax.with_sharding_constraint(variables["params"], drawn_params)
            variables = {**variables, "params": drawn}
        variables = jax.lax.with_sharding_constraint(variables, var_shardings)
        opt_state = None
        if with_optimizer:
            opt_state = holder[ModeKeys.TRAIN].train_op.init(variables.get("params", {}))
        extras = {"step": step, "rng": rng, "nonfinite": jnp.zeros((), jnp.int32)}
        if loss_scale:
            extras["loss_scale"] = precision.initial_loss_scale()
        return variables, opt_state, extras

    return jax.jit(
        fresh,
        out_shardings=(var_shardings, opt_shardings, replicated),
        compiler_options=compiler_options,
    )
