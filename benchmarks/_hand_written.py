"""Trainer features written by hand, as a user of plain JAX would: the baselines of
``feature_costs``.

Each variant is ``_workloads``' ceiling loop (``jit(shard_map(scan(step)))`` over the
``("data",)`` mesh, state donated, Adam) with one feature added in the way the Flax / optax
examples and big_vision write it:

* ``bf16``: the forward and backward in bfloat16 (parameters and inputs cast inside the
  differentiated function), float32 parameters, optimizer state and loss.
* ``microbatches``: the step's gradient summed over 4 micro-batches by a ``lax.scan``.
* ``ema``: a shadow of the parameters, ``d * s + (1 - d) * p`` after every update, with
  TF's ``d = min(decay, (1 + n) / (10 + n))``.
* ``host_call``: the step also returns its loss and accuracy; after each loop the host writes
  both for every step with tensorboardX (CLU's pattern: metrics come back with the loop).
* ``zero1``: ZeRO-1. The gradients, flattened into one vector, are reduce-scattered; each
  replica runs Adam on its slice (its slice of the moments); the updated slices are
  all-gathered back into the replicated parameters.
* ``fsdp``: the parameters too are kept as one slice per replica, all-gathered whole at the
  start of each step.

Example:
  >>> loop = make("mlp", "zero1", make_mesh(), sample_x, logdir="/tmp/hand")
  >>> state = loop.init()
  >>> state, out = loop.run(state, xs, ys)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _workloads as W

DATA = W.DATA
EMA_DECAY = 0.999
MICROBATCHES = 4
VARIANTS = ("plain", "bf16", "microbatches", "ema", "host_call", "zero1", "fsdp")


class HandLoop(NamedTuple):
    """``init()`` -> state on the mesh; ``run(state, xs, ys)`` -> ``(state, outputs)`` (the
    jitted loop); ``after(outputs, first_step)``: the host's work after a loop (or None)."""

    init: Callable[[], Any]
    run: Callable
    after: Callable[[Any, int], None] | None = None


def _varying(tree):
    """Cast to replica-varying, so ``grad`` gives each replica its own gradient (a no-op
    where the shard_map's check is off)."""
    return jax.tree.map(lambda a: lax.pcast(a, DATA, to="varying"), tree)


def _loss_and_grads(model: str, params, x, y, *, bf16: bool = False):
    """The replica's mean loss and its gradient (varying over the data axis)."""
    if not bf16:
        return jax.value_and_grad(lambda p: W._loss(model, p, x, y))(_varying(params))

    def loss(p):
        low = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
        logits = W._module(model).apply({"params": low}, x.astype(jnp.bfloat16))
        per_row = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return per_row.mean()

    return jax.value_and_grad(loss)(_varying(params))


def _accuracy(model: str, params, x, y):
    logits = W._module(model).apply({"params": params}, x)
    return lax.pmean((logits.argmax(-1) == y).mean(), DATA)


def _replicated_step(model: str, variant: str) -> Callable:
    """Steps whose parameters stay whole on every replica: plain, bf16, micro-batches, EMA,
    host_call."""
    tx = optax.adam(W.LEARNING_RATE)
    if variant == "microbatches":
        return W.train_step(model, MICROBATCHES)

    def step(state, batch):
        params, opt_state, *extra = state
        x, y = batch
        loss, grads = _loss_and_grads(model, params, x, y, bf16=variant == "bf16")
        grads, loss = lax.pmean(grads, DATA), lax.pmean(loss, DATA)
        updates, opt_state = tx.update(grads, opt_state, params)
        new = optax.apply_updates(params, updates)
        if variant == "ema":
            shadow, n = extra
            d = jnp.minimum(EMA_DECAY, (1.0 + n) / (10.0 + n))
            shadow = jax.tree.map(lambda s, p: d * s + (1.0 - d) * p, shadow, new)
            return (new, opt_state, shadow, n + 1), loss
        if variant == "host_call":
            return (new, opt_state), (loss, _accuracy(model, params, x, y))
        return (new, opt_state), loss

    return step


class _Flat(NamedTuple):
    """The parameters as one vector padded to a multiple of the replicas."""

    size: int
    padded: int
    unravel: Callable


def _flat_of(params, replicas: int) -> _Flat:
    flat, unravel = ravel_pytree(params)
    return _Flat(flat.size, -(-flat.size // replicas) * replicas, unravel)


def _sharded_step(model: str, flat: _Flat, *, fsdp: bool) -> Callable:
    """ZeRO-1 (``fsdp=False``: state ``(params, opt_slice)``) or FSDP (state ``(param_slice,
    opt_slice)``): Adam on each replica's slice of the flattened parameters."""
    tx = optax.adam(W.LEARNING_RATE)

    def step(state, batch):
        held, opt_state = state
        x, y = batch
        if fsdp:  # the parameters exist whole only inside the step
            params = flat.unravel(lax.all_gather(held, DATA, tiled=True)[: flat.size])
        else:
            params = held
        loss, grads = _loss_and_grads(model, params, x, y)
        g = jnp.pad(ravel_pytree(grads)[0], (0, flat.padded - flat.size))
        g_slice = lax.psum_scatter(g, DATA, tiled=True) / lax.axis_size(DATA)
        if fsdp:
            p_slice = held
        else:
            whole = jnp.pad(ravel_pytree(params)[0], (0, flat.padded - flat.size))
            width = flat.padded // lax.axis_size(DATA)
            p_slice = lax.dynamic_slice(whole, (lax.axis_index(DATA) * width,), (width,))
        updates, opt_state = tx.update(g_slice, opt_state, p_slice)
        p_slice = optax.apply_updates(p_slice, updates)
        loss = lax.pmean(loss, DATA)
        if fsdp:
            return (p_slice, opt_state), loss
        whole = lax.all_gather(p_slice, DATA, tiled=True)[: flat.size]
        return (flat.unravel(whole), opt_state), loss

    return step


def _specs(tree, sliced: bool):
    """Each leaf's PartitionSpec: vectors split over the data axis where ``sliced``."""
    return jax.tree.map(lambda a: P(DATA) if sliced and np.ndim(a) else P(), tree)


def _jit_loop(step: Callable, mesh: Mesh, state_specs, out_specs, *, vma: bool = True):
    """``jit(shard_map(scan(step)))``, the state donated. ``vma=False`` for ZeRO-1 / FSDP,
    whose gathered parameters are the same on every replica although ``all_gather`` types
    them replica-varying (the check is off, as hand-written ZeRO code turns it off)."""

    def loop(state, xs, ys):
        return lax.scan(step, state, (xs, ys))

    sharded = jax.shard_map(
        loop,
        mesh=mesh,
        in_specs=(state_specs, P(None, DATA), P(None, DATA)),
        out_specs=(state_specs, out_specs),
        check_vma=vma,
    )
    return jax.jit(sharded, donate_argnums=0)


def _place(tree, mesh: Mesh, specs):
    return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def make(
    model: str, variant: str, mesh: Mesh, sample_x: np.ndarray, *, logdir: str, seed: int = 0
) -> HandLoop:
    """The hand-written loop of ``variant`` (one of ``VARIANTS``) for ``model``; ``host_call``
    writes its event file under ``logdir``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    params = W._module(model).init(jax.random.key(seed), sample_x[:1])["params"]
    tx = optax.adam(W.LEARNING_RATE)
    if variant in ("zero1", "fsdp"):
        replicas = mesh.shape[DATA]
        flat = _flat_of(params, replicas)
        vector = jnp.pad(ravel_pytree(params)[0], (0, flat.padded - flat.size))
        opt_state = tx.init(vector)  # the slices' moments, split below
        held = vector if variant == "fsdp" else params
        state = (held, opt_state)
        specs = (_specs(held, variant == "fsdp"), _specs(opt_state, True))
        step = _sharded_step(model, flat, fsdp=variant == "fsdp")
        run = _jit_loop(step, mesh, specs, P(), vma=False)
        return HandLoop(lambda: _place(state, mesh, specs), run)
    state = (params, tx.init(params))
    if variant == "ema":
        state = (*state, jax.tree.map(jnp.copy, params), jnp.zeros((), jnp.float32))
    specs = _specs(state, False)
    outputs = (P(), P()) if variant == "host_call" else P()
    run = _jit_loop(_replicated_step(model, variant), mesh, specs, outputs)
    after = _summary_writer(logdir) if variant == "host_call" else None
    return HandLoop(lambda: _place(state, mesh, specs), run, after)


def _summary_writer(logdir: str) -> Callable[[Any, int], None]:
    """The host side of ``host_call``: every step's loss and accuracy into an event file."""
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(logdir)

    def after(outputs, first_step: int) -> None:
        losses, accuracies = jax.device_get(outputs)
        for i, (loss, acc) in enumerate(zip(losses, accuracies)):
            writer.add_scalar("host/loss", float(loss), first_step + i)
            writer.add_scalar("host/accuracy", float(acc), first_step + i)
        writer.flush()

    return after
