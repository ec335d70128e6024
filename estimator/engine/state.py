"""Creating and placing the training state and the variables of a model.

Everything here traces or runs model_fn on an *example*: ``(features, labels)`` as the input
side stacks them for one compiled call (``[steps, global_rows, ...]`` leaves; ``labels`` may
be None). Restoring them from a checkpoint is ``io/restore.py``.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.errors import EstimatorValueError
from ..core.runtime import init_compiler_options, seed_key_data
from ..core.spec import ModeKeys
from ..data.staging import aligned_empty
from ..parallel import partitioning, zero
from ..parallel.mesh import DATA
from . import executables, microbatch
from .loops import TrainState, make_fresh_train_state, make_split_init
from .programs import Programs

log = logging.getLogger("estimator")

# (features, labels) of one compiled call, stacked [steps, global_rows, ...]; labels may be None.
Example = tuple[Any, Any]


def _init_args(programs: Programs, example: Example):
    """(rng, step, features, labels) of the init program: host values and the example's
    stacked arrays (step 0's batch is taken inside the program, not by an eager slice)."""
    rng = seed_key_data(programs.config.tf_random_seed)
    features, labels = example
    return rng, np.int32(0), features, labels


def _tuple_hint(features: Any) -> str:
    """A hint when ``features`` is a tuple of another length than 2 (read as features only)."""
    if not isinstance(features, tuple) or len(features) == 2:
        return ""
    return (
        f" input_fn's batches are {len(features)}-tuples: only a 2-tuple is read as "
        "(features, labels), as in TF; a tuple of another length is all features (a "
        "Keras-style (x, y, sample_weight) is not). Yield (features, labels) and put extra "
        "entries such as weights in the features dict."
    )


def _labels_note(labels: Any) -> str | None:
    """A note naming the shape model_fn got its labels in (``(B, 1)``: B rows of one id),
    for a failure while tracing it; None when labels are not one array of rank 2 or more."""
    shape = getattr(labels, "shape", None)
    if shape is None or len(shape) < 3:  # (B,) labels: nothing worth a note
        return None
    per_row = tuple(shape[2:])  # the example is stacked [steps, rows, ...]
    text = ", ".join(["B", *map(str, per_row)])
    note = f"model_fn was traced with labels of shape ({text}) (B = its batch rows)"
    if per_row == (1,):
        note += (
            ": a model that expects class ids of shape (B,) (e.g. "
            "softmax_cross_entropy_with_integer_labels) fails on (B, 1) labels; yield labels "
            "of shape (B,) from input_fn (labels.reshape(-1)), or reshape them in model_fn"
        )
    return note


def _trace(programs: Programs, mode: str, example: Example, fn, *args):
    """Calls ``fn`` (which traces model_fn); a failure with ``labels=None`` in TRAIN/EVAL is
    re-raised naming the likely culprit: an input_fn that returned no labels. A failure with
    labels gets a note naming their shape (raw shape errors from inside a loss do not)."""
    try:
        return fn(*args)
    except Exception as e:
        if example[1] is not None:
            note = _labels_note(example[1])
            if note is not None and note not in getattr(e, "__notes__", ()):
                e.add_note(note)
            raise
        if mode == ModeKeys.PREDICT:
            raise
        if "labels" not in programs.model.arg_names:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise EstimatorValueError(
            f"model_fn failed in mode {mode!r} with labels=None ({type(e).__name__}: {first}). "
            "input_fn returned features only; return (features, labels) batches, or do not "
            f"use labels in mode {mode!r}.{_tuple_hint(example[0])}"
        ) from e


def _sharded(programs: Programs, boxed: dict) -> tuple[dict, Any]:
    """Unboxes Flax partitioning metadata; returns (variables, NamedShardings) and records
    the PartitionSpecs for the loops (``nn.with_partitioning`` over "model")."""
    specs = partitioning.param_specs(boxed)
    programs.var_specs = specs
    shardings = jax.tree.map(
        lambda spec: NamedSharding(programs.mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
    )
    return partitioning.unbox(boxed), shardings


def abstract_variables(programs: Programs, mode: str, example: Example, batch_size: int) -> dict:
    """Shapes of every variable, by tracing model_fn in ``mode`` (nothing is computed)."""
    init = programs.init(mode, batch_size)
    variables, shardings = _sharded(
        programs,
        _trace(programs, mode, example, jax.eval_shape, init, *_init_args(programs, example)),
    )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), variables, shardings
    )


def split_params(variables: dict) -> tuple[Any, dict]:
    variables = dict(variables)
    params = variables.pop("params", {})
    return params, variables


def to_train_state(variables: dict, train: dict) -> TrainState:
    params, rest = split_params(variables)
    return TrainState(
        params,
        rest,
        train["opt_state"],
        train["step"],
        train["rng"],
        train["nonfinite"],
        train.get("loss_scale"),
    )


def train_state_parts(state: TrainState) -> tuple[dict, dict]:
    variables = {"params": state.params, **state.state}
    train = {
        "opt_state": state.opt_state,
        "step": state.step,
        "rng": state.rng,
        "nonfinite": state.nonfinite,
    }
    if state.loss_scale is not None:  # float16 compute: checkpointed as loss_scale/...
        train["loss_scale"] = state.loss_scale
    return variables, train


def fresh_train_state(
    programs: Programs, example: Example, batch_size: int, make_init_fn=None
) -> TrainState:
    """Initialises every variable and the optimizer state in one compiled program.

    ``make_init_fn()`` is called after model_fn was traced (so the spec's scaffold_fn is
    known); when it returns an init_fn, the variables are replaced on the host first and the
    optimizer state is made from them afterwards. With ``shard_optimizer_state`` /
    ``shard_params`` the state is made split over replicas: the full state never exists on a
    device.
    """
    init = programs.init(ModeKeys.TRAIN, batch_size)
    args = _init_args(programs, example)
    # Tracing (nothing is compiled) learns the shapes, the shardings and the spec; the
    # program below reuses this trace of model_fn.
    boxed = _trace(programs, ModeKeys.TRAIN, example, jax.eval_shape, init, *args)
    shapes, shardings = _sharded(programs, boxed)
    tx = programs.spec(ModeKeys.TRAIN).train_op
    params_shape = shapes.get("params", {})
    microbatch.check_opt_state(jax.eval_shape(tx.init, params_shape))
    over = over_replicas(programs, params_shape, jax.eval_shape(tx.init, params_shape))
    if over is not None:
        shardings = {**shardings, "params": over[0]}
    init_fn = make_init_fn() if make_init_fn is not None else None
    replicated = NamedSharding(programs.mesh, P())
    elements = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))

    def program_of(init, drawn_params=None):
        return make_fresh_train_state(
            init,
            programs.specs,
            var_shardings=shardings,
            replicated=replicated,
            unbox=partitioning.unbox,
            with_optimizer=init_fn is None,
            opt_shardings=None if over is None else over[1],
            compiler_options=init_compiler_options(elements),
            drawn_params=drawn_params,
            loss_scale=programs.options.policy.loss_scaled,
        )

    if init_fn is None:  # the train loop compiles on a thread while init's program does
        programs.compile_train_ahead(shapes, shardings, example)
    rng, _, features, labels = args
    program = program_of(init)
    if over is not None:  # split state: each device initialises only its slices
        drawn = _split_params(programs, params_shape)
        program = _split_init_program(programs, program_of, drawn, batch_size, args) or program
    variables, opt_state, train = executables.call(program, rng, features, labels)
    if init_fn is not None:
        variables = jax.device_put(init_fn(jax.device_get(variables)), shardings)
        params, _ = split_params(variables)
        opt_state = jax.jit(tx.init, out_shardings=None if over is None else over[1])(params)
    # Leaves the compiler left off the mesh (a scalar such as Adam's count may land on one
    # device) go on it, or the second loop call would see a new input sharding and compile
    # again.
    opt_state = jax.tree.map(
        lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated),
        opt_state,
    )
    return to_train_state(variables, {"opt_state": opt_state, **train})


def _split_params(programs: Programs, params: Any) -> Any:
    """Parameter shardings split over replicas (what ``shard_params`` keeps at rest)."""
    specs = zero.param_specs(
        params, param_model_specs(programs), num_replicas=programs.mesh.shape[DATA]
    )
    return zero.named(programs.mesh, specs)


def _split_init_program(programs: Programs, program_of, drawn, batch_size: int, args: tuple):
    """The fresh-state program built on ``make_split_init``, parameters drawn split as
    ``drawn``, lowered; None if model_fn cannot initialise outside the replicas'
    ``shard_map`` (e.g. it names ``"data"``)."""
    split = make_split_init(
        programs.model, programs.specs, mode=ModeKeys.TRAIN, batch_size=batch_size
    )
    rng, _, features, labels = args
    try:
        return program_of(split, drawn).lower(rng, features, labels).compile()
    except NameError:  # an unbound axis name: it needs the shard_map
        log.debug("model_fn initialises over the replicas' axis: whole state per device")
        return None


def param_model_specs(programs: Programs) -> Any:
    return None if programs.var_specs is None else programs.var_specs.get("params")


def over_replicas(programs: Programs, params: Any, opt_state: Any) -> tuple[Any, Any] | None:
    """(params, opt_state) shardings split over replicas (``TPUConfig.shard_optimizer_state``
    / ``shard_params``); None when the state is replicated."""
    options = programs.options
    if not options.sharded_state:
        return None
    tx = programs.spec(ModeKeys.TRAIN).train_op
    return zero.state_shardings(
        programs.mesh,
        tx,
        params,
        opt_state,
        param_model_specs(programs),
        shard_params=options.sharded_params,
    )


def one_copy_on_cpu(tree: Any) -> Any:
    """Replicated arrays on several CPU devices, re-placed so every device reads one buffer.

    CPU devices share the host's memory and caches, and the arrays a program or a restore
    made hold a private copy per device: eight copies of the same weights fill eight times
    the cache, and a short eval program ran about 10% slower on them than on one shared
    copy (docs/performance.md). A 64-byte-aligned host array placed on every device is
    shared without a copy (XLA:CPU's zero-copy rule). For read-only use (the eval and predict
    loops do not donate their variables); other leaves and platforms are returned as is.
    """

    def one(x: Any) -> Any:
        if (
            not isinstance(x, jax.Array)
            or len(x.sharding.device_set) < 2
            or not x.is_fully_addressable
            or not x.sharding.is_fully_replicated
            or next(iter(x.sharding.device_set)).platform != "cpu"
        ):
            return x
        host = aligned_empty(x.shape, x.dtype)
        host[...] = np.asarray(x)
        return jax.device_put(host, x.sharding)

    return jax.tree.map(one, tree)
