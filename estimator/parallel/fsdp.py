"""FSDP's per-use gathers: each split parameter gathered just before the operation that reads it.

``zero.gather_params`` gathers every split parameter at the top of the loss, and nothing in
the program says when each gather must run: XLA:CPU's scheduler starts them all at once, and
the step holds the whole model (the issue's "ZeRO-3 saves no more than ZeRO-1"). PyTorch's
FSDP gathers a layer's parameters in a hook just before the layer runs and again before its
backward pass. ``gathered_at_use`` does the same at the level of the program, for any model:

* it traces the loss of the split parameters (``zero.gather_params`` inside) to a jaxpr and
  runs it equation by equation, holding back each parameter's gather (and the casts,
  reshapes and names applied to the whole value) until the first equation that computes
  with it;
* that equation runs as one ``custom_vjp`` "use": its forward pass makes the slice depend
  on the equation's other inputs (``_tie``) before gathering, so the gather cannot start
  before the layer's input exists; its backward pass ties the slice to the incoming
  cotangent and gathers it again, so the backward gather waits for the layer's turn too,
  and computes the cotangent of the layer's input before the parameter's whole gradient,
  so the gathered value is dead when that gradient is made. The gathered value is never a
  residual: between its uses the step holds only the slice;
* a ``scan`` over a stack of layers (``nn.scan``: stacked parameters as its scanned inputs)
  is run again with each iteration's slice held back the same way inside the body
  (``_scan``), so the step gathers one layer of the stack at a time, not the stack.

The gradient is the same as through ``zero.gather_params`` (the pullback of the gather is
its transpose, the reduce-scatter): each split leaf's gradient arrives summed over replicas
and split like the parameter, ready for ``zero.scattered_mean``. A parameter read by several
equations is gathered for each; their gradients add.

Example:
  >>> def loss(slices):                      # inside a shard_map over "data"
  ...     return model_loss(zero.gather_params(slices, specs))
  >>> grads = jax.grad(gathered_at_use(loss))(slices)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.dtypes import float0
from jax.extend.core import Literal

from .mesh import DATA

#: Primitives that, applied to a held-back parameter alone, stay held back with it.
_FOLLOWERS = frozenset({"all_gather", "name", "convert_element_type", "copy", "reshape", "pcast"})


class _Held(NamedTuple):
    """A parameter not yet gathered: its slice and the equations that make its value."""

    slice: Any
    chain: tuple  # equations with one non-literal input each, applied in order
    gathers: bool  # the chain holds an all_gather over "data"


def gathered_at_use(fn: Callable) -> Callable:
    """``fn`` with each parameter gathered where it is used (see the module docstring).

    Args:
      fn: a function of the split parameters (a pytree) whose body gathers them with
        ``zero.gather_params``; it may return any pytree (``has_aux`` outputs included).

    Returns:
      A function of the same arguments and results, to differentiate in its place.
    """

    def wrapped(params):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(params)
        outs = _run(closed.jaxpr, closed.consts, jax.tree.leaves(params))
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return wrapped


def _bind(eqn, invals: Sequence) -> list:
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _replay(chain: tuple, x):
    for eqn in chain:
        (x,) = _bind(eqn, [v.val if isinstance(v, Literal) else x for v in eqn.invars])
    return x


def _gathers(eqn) -> bool:
    if eqn.primitive.name != "all_gather":
        return False
    axes = eqn.params.get("axis_name")
    return DATA in (axes if isinstance(axes, tuple) else (axes,))


def _side_effects(eqn) -> bool:
    # A collective's effect only names its axis; anything else (callbacks, I/O) is run as is.
    return any(type(e).__name__ != "NamedAxisEffect" for e in eqn.effects)


def _follows(eqn, held: dict) -> bool:
    """Whether ``eqn`` only transforms one held-back parameter (so it is held back too)."""
    if eqn.primitive.name not in _FOLLOWERS or len(eqn.outvars) != 1 or _side_effects(eqn):
        return False
    inputs = [v for v in eqn.invars if not isinstance(v, Literal)]
    return len(inputs) == 1 and inputs[0] in held


def _run(jaxpr, consts: Sequence, args: Sequence) -> list:
    """Runs ``jaxpr``; an argument given as a ``_Held`` is held back as it says."""
    env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
    held: dict = {
        v: x if isinstance(x, _Held) else _Held(x, (), False)
        for v, x in zip(jaxpr.invars, args, strict=True)
    }

    def read(v):
        if isinstance(v, Literal):
            return v.val
        if v in held:  # read whole where the program needs it as a value (an output)
            h = held[v]
            return _replay(h.chain, h.slice)
        return env[v]

    for eqn in jaxpr.eqns:
        if _follows(eqn, held):
            (src,) = [v for v in eqn.invars if not isinstance(v, Literal)]
            h = held[src]
            held[eqn.outvars[0]] = _Held(h.slice, (*h.chain, eqn), h.gathers or _gathers(eqn))
            continue
        slots = [i for i, v in enumerate(eqn.invars) if _gathering(v, held)]
        if not slots or _side_effects(eqn):
            outs = _bind(eqn, [read(v) for v in eqn.invars])
        elif (chains := _stack_chains(eqn, held)) is not None:
            outs = _scan(eqn, chains, held, read)
        else:
            outs = _use(eqn, slots, [held[eqn.invars[i]] for i in slots], read)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _per_iteration(chain: tuple) -> tuple | None:
    """``chain`` for one slice of a stacked parameter (its leading, scanned axis removed),
    or None where it cannot be: the gather is along the scanned axis, or a step reshapes."""
    out = []
    for eqn in chain:
        params = eqn.params
        if eqn.primitive.name == "all_gather":
            if params["all_gather_dimension"] == 0:
                return None
            params = {**params, "all_gather_dimension": params["all_gather_dimension"] - 1}
        elif eqn.primitive.name == "reshape" or params.get("sharding") is not None:
            return None
        out.append(eqn.replace(params=params))
    return tuple(out)


def _gathering(v, held: dict) -> bool:
    return not isinstance(v, Literal) and v in held and held[v].gathers


def _stack_chains(eqn, held: dict) -> list | None:
    """For a scan over a stack of layers, each scanned input's per-iteration chain (None
    for an input read as it is); None when ``eqn`` is no such scan: not a scan, or none of
    its scanned inputs (``xs``) is a held-back parameter whose gather works on one
    iteration's slice. A scan that only reads held-back parameters whole (an RNN's weights)
    is one use, gathered once each way (``_use``), not once per iteration."""
    if eqn.primitive.name != "scan":
        return None
    xs = eqn.invars[eqn.params["num_consts"] + eqn.params["num_carry"] :]
    chains = [_per_iteration(held[v].chain) if _gathering(v, held) else None for v in xs]
    return chains if any(c is not None for c in chains) else None


def _scan(eqn, chains: list, held: dict, read: Callable) -> list:
    """A ``lax.scan`` over a stack of layers (``nn.scan``), run again with each iteration's
    slice of the stacked parameters gathered where that iteration uses it, so the step
    holds one layer of the stack, not all of it. The body's other held-back parameters
    (read by every layer) are gathered at their uses inside it too, as each layer would
    gather them; a stacked parameter split along the scanned axis is gathered whole before
    the scan."""
    p = eqn.params
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    consts = [held[v] if _gathering(v, held) else read(v) for v in eqn.invars[:n_consts]]
    scanned = eqn.invars[n_consts + n_carry :]
    xs = [read(v) if c is None else held[v].slice for v, c in zip(scanned, chains, strict=True)]

    def body(carry, xs_i):
        xs_i = [x if c is None else _Held(x, c, True) for x, c in zip(xs_i, chains, strict=True)]
        outs = _run(p["jaxpr"].jaxpr, p["jaxpr"].consts, [*consts, *carry, *xs_i])
        return outs[:n_carry], outs[n_carry:]

    carry, ys = lax.scan(
        body,
        [read(v) for v in eqn.invars[n_consts : n_consts + n_carry]],
        xs,
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
        _split_transpose=p.get("_split_transpose", False),
    )
    return [*carry, *ys]


def _tie(values: Any, anchors: Any) -> Any:
    """``values`` (a pytree) made to depend on ``anchors``' values, so nothing computed from
    them can run before the anchors exist.

    ``lax.optimization_barrier`` says this, but XLA:CPU expands barriers before it schedules
    (and common-subexpression elimination then merges the forward and backward gathers), so
    the dependence is made real: one element of each anchor, times zero, added to each value
    (an add over 1/N of a layer, or over a cotangent; a non-finite anchor makes the step's
    gradient non-finite, as it already is).
    """
    floats = [
        a
        for a in jax.tree.leaves(anchors)
        if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating) and a.size
    ]
    if not floats:
        return values
    first = [lax.stop_gradient(a.reshape(-1)[0]).astype(jnp.float32) for a in floats]
    zero = sum(first[1:], first[0]) * 0.0

    def one(v):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            return v
        return v + zero.astype(v.dtype)

    return jax.tree.map(one, values)


def _instantiate(ct):
    """A cotangent as an array (an unused output's cotangent comes as a ``SymbolicZero``)."""
    if not isinstance(ct, SymbolicZero):
        return ct
    if ct.aval.dtype == float0:
        return np.zeros(ct.aval.shape, float0)
    zeros = jnp.zeros(ct.aval.shape, ct.aval.dtype)
    vma = tuple(getattr(ct.aval, "vma", ()))
    return lax.pcast(zeros, vma, to="varying") if vma else zeros


def _use(eqn, slots: list[int], helds: list[_Held], read: Callable) -> list:
    """``eqn`` applied to its held-back parameters, each gathered in its forward and again in
    its backward pass, tied to the equation's inputs and to its cotangents."""
    chains = [h.chain for h in helds]
    # the equation's other inputs: arguments of the custom_vjp, literals closed over
    free = [i for i, v in enumerate(eqn.invars) if i not in slots and not isinstance(v, Literal)]
    others = [read(eqn.invars[i]) for i in free]

    def apply(slices, rest):
        vals = [v.val if isinstance(v, Literal) else None for v in eqn.invars]
        for j, i in enumerate(slots):
            vals[i] = _replay(chains[j], slices[j])
        for j, i in enumerate(free):
            vals[i] = rest[j]
        return _bind(eqn, vals)

    needs: list[bool] = []  # which of ``rest`` carry a derivative (seen by the forward)

    @jax.custom_vjp
    def use(slices, rest):
        return apply(_tie(slices, rest), rest)

    def forward(slices, rest):
        needs[:] = [p.perturbed for p in rest]
        slices, rest = [p.value for p in slices], [p.value for p in rest]
        # the gathers wait for the equation's other inputs (the layer's input activations)
        return apply(_tie(slices, rest), rest), (slices, rest)

    def backward(res, cts):
        slices, rest = res
        cts = [_instantiate(c) for c in cts]
        # ... and, in the backward pass, for the cotangent of the equation's outputs. The
        # cotangent of the other inputs comes first, so the gathered value is dead before
        # the parameter's whole gradient (reduce-scattered at once) is made.
        wanted = [i for i, n in enumerate(needs) if n]
        ct_rest: list = [None] * len(rest)
        if wanted:
            tied = _tie(slices, cts)

            def of_wanted(sub):
                r = list(rest)
                for i, v in zip(wanted, sub, strict=True):
                    r[i] = v
                return apply(tied, r)

            _, pull = jax.vjp(of_wanted, [rest[i] for i in wanted])
            (got,) = pull(cts)
            for i, g in zip(wanted, got, strict=True):
                ct_rest[i] = g
            cts = _tie(cts, got)
        _, pull_slices = jax.vjp(lambda s: apply(s, rest), slices)
        (ct_slices,) = pull_slices(cts)
        return ct_slices, ct_rest

    use.defvjp(forward, backward, symbolic_zeros=True)
    return use([h.slice for h in helds], others)
