"""Restoring the training state and a model's variables from the checkpoints of a model_dir.

The templates (shapes, dtypes and shardings) come from tracing model_fn on an example
(``engine/state.py``); Orbax then reads each array straight into its place. What the last
``train`` left in memory (``StateStore.last``) is used instead of a reload when it is the
newest checkpoint. Evaluate and predict keep the variables they placed for their loops
(``StateStore.placed``): a later call for the same checkpoint reads and places nothing.

Example:
  >>> got = restore_train_state(programs, store, (features, labels), batch_size=8)
  >>> state, meta = got if got is not None else (fresh_train_state(...), {})
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import storage
from ..core.errors import CheckpointError, NoCheckpointError
from ..core.spec import ModeKeys
from ..engine import precision
from ..engine.loops import TrainState
from ..engine.programs import Programs
from ..engine.state import (
    Example,
    abstract_variables,
    over_replicas,
    param_model_specs,
    split_params,
    to_train_state,
    train_state_parts,
)
from ..parallel import multihost, zero
from . import checkpoint as ckpt_lib
from . import checkpoint_read
from . import variables as variables_lib
from .model_dir import resolve_path
from .store import StateStore

log = logging.getLogger("estimator")

_ROTATION_RETRIES = 2  # reads of the newest step again when it is rotated away mid-read


def _replicated(mesh: Mesh, tree: Any) -> Any:
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _train_extras(programs: Programs, params: Any) -> dict:
    tx = programs.spec(ModeKeys.TRAIN).train_op
    extras = {
        "opt_state": jax.eval_shape(tx.init, params),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32),
        "nonfinite": jax.ShapeDtypeStruct((), jnp.int32),
    }
    if programs.options.policy.loss_scaled:
        extras["loss_scale"] = precision.loss_scale_shapes()  # float16's dynamic loss scale
    return extras


def _with_shardings(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _gathered(programs: Programs, variables: dict) -> dict:
    """Variables whose params are split over replicas (``shard_params``), whole again."""
    if not programs.options.sharded_params:
        return variables
    params, rest = split_params(variables)
    specs = zero.resolved_model_specs(params, param_model_specs(programs))
    leaves, tree = jax.tree.flatten(zero.named(programs.mesh, specs))
    return {"params": _gather_program(tree, tuple(leaves))(params), **rest}


def _identity(tree: Any) -> Any:
    return tree


@functools.lru_cache(maxsize=8)
def _gather_program(tree: Any, shardings: tuple) -> Callable:
    """The one program per layout that makes split params whole (``_gathered``): compiled by
    the first evaluate or predict after ``train`` (cheaper than reading the checkpoint back),
    reused by every later one (a new ``jax.jit`` per call compiled each time)."""
    return jax.jit(_identity, out_shardings=jax.tree.unflatten(tree, shardings))


def restore_train_state(
    programs: Programs, store: StateStore, example: Example, batch_size: int
) -> tuple[TrainState, dict] | None:
    """The newest readable checkpoint as a TrainState, with its meta; None if there is none."""
    ckpts = store.writer()
    steps = ckpts.steps()
    if not steps:
        return None
    last = store.last
    if last is not None and last.step == steps[-1]:  # what the last train() left: no reload
        return last.state, last.meta
    variables = abstract_variables(programs, ModeKeys.TRAIN, example, batch_size)
    params, _ = split_params(variables)
    train = _replicated(programs.mesh, _train_extras(programs, params))
    shardings = over_replicas(programs, params, train["opt_state"])
    if shardings is not None:  # Orbax restores each array straight into its shard layout
        variables["params"] = _with_shardings(params, shardings[0])
        train["opt_state"] = _with_shardings(train["opt_state"], shardings[1])
    got = ckpts.restore_latest(variables=variables, train=train, quarantine=True)
    if got is None:
        return None
    step, out = got
    log.info("Restored checkpoint %s", ckpts.path(step))
    return to_train_state(out["variables"], out["train"]), out["meta"]


def restore_variables(
    programs: Programs,
    store: StateStore,
    mode: str,
    example: Example,
    batch_size: int,
    checkpoint_path: str | None,
    *,
    saver_sources: Callable[[Callable | None], dict[str, str] | None] | None = None,
    place: Callable[[dict], dict] | None = None,
) -> tuple[dict, int]:
    """Variables for evaluate/predict/export from ``checkpoint_path`` or the latest checkpoint.

    ``saver_sources(scaffold_fn)`` (``scaffold.saver_sources``, passed in by the driver) gives
    the ``{model variable: checkpoint name}`` mapping of the spec's
    ``Scaffold(saver=Saver(var_list))`` (TF's EMA evaluation), or None. A checkpoint holding
    variables the model lacks is read too, the extras named once in the log (training's
    resume stays strict).

    ``place(variables)`` (evaluate and predict: placed for their loops) is applied to what is
    returned, and the result is kept in the store (``StateStore.placed``, one checkpoint's):
    a later call for the same checkpoint, mode and batch size reads nothing from disk and
    places nothing. The checkpoint is known by its directory's stamp, so a newer one, or one
    written again at the same step, is read again; the store drops the copy when training
    takes the memory back (``StateStore.forget``).

    Raises:
      NoCheckpointError: no checkpoint exists (TF: "Could not find trained model").
    """
    model_dir, step = resolve_path(checkpoint_path, store.model_dir)
    ckpts = store.reader(model_dir)
    read = functools.partial(
        _read, programs, store, mode, example, batch_size, ckpts, model_dir, step, saver_sources
    )
    if place is None:
        return read()
    key = _placed_key(ckpts, step, mode, batch_size)
    kept = store.placed
    hit = key is not None and kept is not None and kept.key == key and _alive(kept.variables)
    (miss,) = multihost.any_of(not hit)  # every process reads, or none (a read may sync them)
    if not miss:
        if not programs.traced(mode):  # trace model_fn once so its spec is known
            abstract_variables(programs, mode, example, batch_size)
        return kept.variables, kept.global_step
    store.placed = None  # the copy kept goes before another is read
    variables, global_step = read()
    variables = place(variables)
    if key is not None and global_step == key[1]:  # not an older step read instead
        store.placed = Placed(key, variables, global_step)
    return variables, global_step


class Placed(NamedTuple):
    """Variables evaluate or predict placed for their loops, kept for the next call of the
    same checkpoint (``restore_variables(place=...)``)."""

    key: tuple  # ``_placed_key``: the checkpoint's stamp and step, the mode, the batch size
    variables: dict
    global_step: int


def _placed_key(
    ckpts: ckpt_lib.Checkpoints, step: int | None, mode: str, batch: int
) -> tuple | None:
    """What a restore of ``step`` (None: the newest) gives, from one listing and one stat:
    the step directory's stamp (a new run's checkpoint at the same step is another
    directory), the step, the mode and the batch size; None when there is no checkpoint."""
    wanted = step if step is not None else ckpts.newest_step()
    stamp = None if wanted is None else storage.stamp(ckpts.path(wanted))
    return None if stamp is None else (stamp, wanted, mode, batch)


def _alive(tree: Any) -> bool:
    """Whether no array of ``tree`` was deleted (donated to a loop) since it was kept."""
    return not any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(tree))


def _read(
    programs: Programs,
    store: StateStore,
    mode: str,
    example: Example,
    batch_size: int,
    ckpts: ckpt_lib.Checkpoints,
    model_dir: str,
    step: int | None,
    saver_sources: Callable | None,
) -> tuple[dict, int]:
    """``restore_variables`` without ``place``: what ``train`` left in memory, else disk."""

    def sources() -> dict[str, str] | None:
        # The scaffold_fn model_fn last returned in this mode (a cached trace records no spec).
        scaffold_fn = programs.model.scaffold_fns.get(mode)
        return None if saver_sources is None else saver_sources(scaffold_fn)

    last = store.last
    if last is not None and store.owns(model_dir) and step in (None, last.step):
        if ckpts.newest_step() == last.step:  # the latest checkpoint is what we hold
            if not programs.traced(mode):  # trace model_fn once so its spec is known
                abstract_variables(programs, mode, example, batch_size)
            if sources() is None:  # a Saver reads other values than the ones trained
                variables, _ = train_state_parts(last.state)
                shadow = variables_lib.moving_average_for_eval(last.state.opt_state)
                return _averaged(_gathered(programs, variables), shadow, last.step), last.step
    template = abstract_variables(programs, mode, example, batch_size)
    for attempt in range(_ROTATION_RETRIES + 1):
        read_step = functools.partial(_read_step, ckpts, template=template, sources=sources())
        got = ckpts.restore_latest(step=step, read=read_step)
        if got is None:
            raise NoCheckpointError(f"Could not find trained model in model_dir: {model_dir}")
        read, out = got
        try:
            # Checkpoints written before the flag existed are looked into.
            has = out["meta"].get("moving_average", True)
            shadow = checkpoint_read.moving_average_for_eval(ckpts, read) if has else None
        except CheckpointError:
            # A trainer rotating checkpoints away may delete the step between the two reads:
            # read the newest again (a step asked for by path is not retried).
            if step is not None or attempt == _ROTATION_RETRIES:
                raise
            continue
        global_step = int(np.asarray(out["meta"]["global_step"]))
        return _averaged(out["variables"], shadow, read), global_step
    raise AssertionError("unreachable")  # the last attempt returns or raises


def _read_step(
    ckpts: ckpt_lib.Checkpoints, step: int, *, template: Any, sources: dict[str, str] | None
) -> dict:
    """One step's variables for evaluate, predict or export. A Saver's mapping (``sources``,
    ``{model variable: checkpoint name}``), or a checkpoint holding variables the model lacks
    (an EMA run's averages evaluated with EMA off), reads by name: the extras are left out and
    named once in the log. Otherwise the whole item is restored, as training's resume does."""
    meta = ckpts.meta(step)  # first: a damaged step is named as a whole restore names it
    saved = ckpts.saved_shapes(step, "variables")
    if sources or not set(saved) <= set(variables_lib.shapes(template)):
        variables = checkpoint_read.restore_mapped(ckpts, step, template, sources)
        return {"variables": variables, "meta": meta}
    return ckpts.restore(step, variables=template, meta=meta)


def _averaged(variables: dict, shadow: dict | None, step: int) -> dict:
    """``variables`` with the averaged ones replaced by an ``ExponentialMovingAverage(
    use_for_eval=True)``'s shadow (``{variable name: array}``: params, and BatchNorm
    statistics under ``ema.apply(var_list)``; None: unchanged), placed as they are."""
    if not shadow:
        return variables
    log.info("Using the moving averages of the parameters (step %d) for this run", step)

    def place(name: str, raw: Any) -> Any:
        value = shadow.get(name, raw)
        if isinstance(value, np.ndarray):
            value = value.astype(raw.dtype, copy=False)
        return jax.device_put(value, raw.sharding)

    named = variables_lib.flatten(variables)
    averaged = {n: place(n, x) for n, x in named.items() if n in shadow}
    return variables_lib.unflatten_into(variables, averaged)
