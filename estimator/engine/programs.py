"""The compiled programs of one estimator and what tracing model_fn taught.

``Programs`` builds each loop once per (kind, batch size) and keeps it, so a second
``evaluate`` or the evaluations between training rounds compile nothing. The train loop
compiles on a thread while init does, and in ``train_and_evaluate`` the evaluation program
while training runs (``compile_train_ahead`` / ``compile_eval_ahead``, ``engine/ahead.py``).
Tracing model_fn records the spec of each mode (``spec(mode)``) and the variables' partition
specs (``var_specs``, known after the first trace), which later programs and restores need.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.config import RunConfig
from ..core.errors import EstimatorValueError
from ..core.runtime import seed_key_data
from ..core.spec import ModeKeys, TPUEstimatorSpec
from ..data import plan
from ..parallel import multihost, partitioning
from ..parallel.mesh import DATA
from . import ahead
from .loops import SpecHolder, TrainState, make_eval_loop, make_init, make_train_loop
from .model import ModelFn
from .options import StepOptions, loop_unrolled
from .tails import CallCosts

log = logging.getLogger("estimator")


# A train call's input state is kept for a replay (the check of a call's result finds the
# step only on failure) when the copies that costs fit in this share of a device's memory;
# otherwise every step is checked, which costs a pass over the state per step. Kept, the
# state is not donated: two copies are alive where donation keeps one (such a call is
# fetched before the next is launched), and on CPU the host's peak grew by about twice the
# state's size (docs/performance.md, finding 17): counted as two more copies.
KEPT_STATE_SHARE = 1 / 16
KEPT_COPIES = 2


def _shard_bytes(x: Any) -> int:
    """Bytes of one device's part of an array (or of a ``ShapeDtypeStruct`` with sharding)."""
    sharding = getattr(x, "sharding", None)
    shape = x.shape if sharding is None else sharding.shard_shape(x.shape)
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def _device_bytes(mesh: Mesh) -> int:
    """A device's memory: its allocator's limit, or on CPU (no limit reported) the host's
    physical memory shared by its local devices."""
    device = mesh.local_devices[0]  # another process's device reports no memory
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(1, len(mesh.local_devices))


def _train_steps(args: tuple) -> int:
    """The steps of a train loop call ``(state, features, labels)``."""
    return jax.tree.leaves(args[1])[0].shape[0]


class Programs:
    """Compiled init, train, eval and predict loops, cached by batch size.

    Args:
      model: the user's model_fn under its Flax root.
      mesh: the ``("data", "model")`` mesh the loops run on.
      config: the estimator's ``RunConfig``.

    Example:
      >>> programs = Programs(model, mesh, config)
      >>> loop = programs.train(batch_size=16)       # compiled on first call, then cached
      >>> programs.spec(ModeKeys.TRAIN).train_op     # known once model_fn was traced
    """

    def __init__(self, model: ModelFn, mesh: Mesh, config: RunConfig):
        self.model, self.mesh, self.config = model, mesh, config
        self.specs = SpecHolder()
        # PartitionSpecs of the variables (``nn.with_partitioning``), set by the first trace.
        self.var_specs: Any = None
        self._cache: dict[tuple, Callable] = {}
        self._costs: dict[tuple, CallCosts] = {}

    @functools.cached_property
    def options(self) -> StepOptions:
        """The train step's options, resolved once from the config and the mesh (on first
        use): what every reader of a step decision reads (``engine/options.py``)."""
        return StepOptions.of(self.config, self.mesh)

    def spec(self, mode: str) -> TPUEstimatorSpec:
        """The spec model_fn returned in ``mode`` (after a program of that mode was traced)."""
        return self.specs[mode]

    def traced(self, mode: str) -> bool:
        return mode in self.specs

    def init(self, mode: str, batch_size: int) -> Callable:
        """``init(rng, step, features, labels) -> variables`` for ``mode``."""
        return self._get(
            ("init", mode, batch_size),
            lambda: make_init(self.model, self.mesh, self.specs, mode=mode, batch_size=batch_size),
        )

    def train(self, batch_size: int, *, per_step_flags: bool = False) -> Callable:
        """``loop(state, features, labels) -> (state, (losses, host, finite))`` over stacked
        steps (``finite``: all-finite flags of the state the call returns, ``[leaves]``, or
        with ``per_step_flags`` of every step's, ``[n, leaves]``; ``loops.finite_flags``).

        The per-step program donates its input state. The other keeps it (a non-finite
        result is replayed from it with per-step flags to find the step) unless non-finite
        steps are skipped: then a finite input state gives a finite result, so only the
        state a call starts from can be the culprit, and the state is donated."""
        return self._get(
            ("train", batch_size, per_step_flags),
            lambda: ahead.AheadCall(
                self._make_train_loop(batch_size, per_step_flags), steps_of=_train_steps
            ),
        )

    def train_for(self, state: Any, batch_size: int) -> Callable:
        """The train program a call on ``state`` runs: ``train(batch_size, per_step_flags=
        per_step_flags(state))``. Training, compiling ahead and the memory figures all take
        it from here, so they measure the program that runs."""
        return self.train(batch_size, per_step_flags=self.per_step_flags(state))

    def keeps_train_input(self) -> bool:
        """Whether the per-call train program keeps (does not donate) its input state."""
        return self.options.keeps_input(per_step_flags=False)

    def per_step_flags(self, state: Any) -> bool:
        """Whether training checks the state every step (``train(per_step_flags=True)``):
        only when keeping a call's input state for a replay is not cheap, i.e. the
        ``KEPT_COPIES`` more copies of the state (``TrainState`` of arrays or
        ``ShapeDtypeStruct``s with shardings) take more than ``KEPT_STATE_SHARE`` of a
        device's memory."""
        if not self.keeps_train_input():
            return False
        held = (state.params, state.state, state.opt_state)
        per_device = sum(_shard_bytes(x) for x in jax.tree.leaves(held))
        return KEPT_COPIES * per_device > KEPT_STATE_SHARE * _device_bytes(self.mesh)

    def _make_train_loop(self, batch_size: int, per_step_flags: bool) -> Callable:
        return make_train_loop(
            self.model,
            self.mesh,
            self.specs,
            self.options,
            batch_size=batch_size,
            var_specs=self.var_specs,
            input_specs=self.input_specs(),
            per_step_flags=per_step_flags,
        )

    def compile_train_ahead(self, shapes: dict, shardings: Any, example: tuple) -> bool:
        """Starts compiling the train loop for calls like ``example`` (the first call's
        stacked ``(features, labels)``) on a thread, while the
        program that makes a fresh state compiles (``engine/state.py``): two independent
        compiles, overlapped. ``shapes`` / ``shardings`` are the unboxed variables' and their
        NamedShardings. Returns whether it started: only for a replicated state on one
        process (otherwise the loop's input shardings are the compiler's to choose)."""
        if (
            multihost.is_multiprocess()
            or self.options.policy.loss_scaled  # the state carries a loss scale: built as before
            or self.options.sharded_state
            or not all(s.is_fully_replicated for s in jax.tree.leaves(shardings))
        ):
            return False
        replicated = NamedSharding(self.mesh, P())

        def rep(tree):
            return jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree
            )

        params = shapes.get("params", {})
        rest = {k: v for k, v in shapes.items() if k != "params"}
        opt_state = jax.eval_shape(self.spec(ModeKeys.TRAIN).train_op.init, params)
        rng = seed_key_data(self.config.tf_random_seed)
        scalar = jax.ShapeDtypeStruct((), np.int32, sharding=replicated)
        state = TrainState(
            rep(params),
            rep(rest),
            rep(opt_state),
            scalar,
            jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=replicated),
            scalar,
        )

        def like(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

        features, labels = jax.tree.map(like, tuple(example))
        leaves = jax.tree.leaves(features)
        batch = leaves[0].shape[1] // self.mesh.shape[DATA]
        loop = self.train_for(state, batch)
        loop.compile_ahead(leaves[0].shape[0], (state, features, labels))
        return True

    def infer(self, mode: str, batch_size: int) -> Callable:
        """The EVAL or PREDICT loop: ``loop(variables, step, rng, features, labels, mask)``."""
        if mode not in (ModeKeys.EVAL, ModeKeys.PREDICT):
            raise EstimatorValueError(f"infer() runs EVAL or PREDICT, got mode {mode!r}")
        return self._get(
            (mode, batch_size),
            lambda: ahead.AheadCall(
                make_eval_loop(
                    self.model,
                    self.mesh,
                    self.specs,
                    mode=mode,
                    batch_size=batch_size,
                    unroll=self.unrolled(mode),
                    input_specs=self.input_specs(),
                    policy=self.options.policy,
                ),
                steps_of=lambda args: args[5].shape[0],  # the mask's steps
            ),
        )

    def compile_eval_ahead(self, state: Any, chunk: Any, layout: Any, *, steps: int | None) -> bool:
        """Starts compiling the first program of an evaluation of ``steps`` steps (None: its
        whole input) on a thread, while training runs (``train_and_evaluate``). Its input is
        taken to be shaped like the training ``chunk``'s per example, at the eval
        ``layout``'s rows; ``state`` is the ``TrainState`` whose variables evaluation will
        read. Returns whether it started: not with several processes, parameters split over
        replicas or an unknown eval batch size (those evaluations compile as before)."""
        rows = None if layout.broadcast else layout.process_rows
        variables = {"params": state.params, **state.state}
        sig = ahead.chunk_signature(chunk)
        tpu = self.config.tpu_config
        if not rows or multihost.is_multiprocess() or self.options.sharded_params:
            return False
        replicas = self.mesh.shape[DATA]
        row_bytes = sum(
            int(np.prod(s, dtype=np.int64)) * d.itemsize for s, d in zip(sig.shapes, sig.dtypes)
        )
        steps = ahead.first_eval_call(
            rows=rows,
            row_bytes=row_bytes,
            local_replicas=replicas,
            budget=plan.input_budget(
                tpu.max_staged_input_bytes,
                platform=self.mesh.devices.flat[0].platform,
                local_devices=len(self.mesh.local_devices),
                mode=ModeKeys.EVAL,
            ),
            iterations_per_loop=tpu.iterations_per_loop,
            steps=steps,
            merge_loops=not self.unrolled(ModeKeys.EVAL),
        )
        if steps <= 0:
            return False
        batch = rows // replicas
        specs = ahead.eval_call_specs(
            self.mesh,
            variables,
            sig,
            rows=rows,
            steps=steps,
            rng=seed_key_data(self.config.tf_random_seed),
        )
        done = self.costs(ModeKeys.EVAL, batch).ahead(steps)
        self.infer(ModeKeys.EVAL, batch).compile_ahead(steps, specs, on_done=done)
        log.debug("Compiling the evaluation program (%d steps) while training runs", steps)
        return True

    def costs(self, mode: str, batch_size: int) -> CallCosts:
        """What the EVAL or PREDICT calls at ``batch_size`` cost so far (``engine/tails.py``):
        how a tail the input cuts short runs is chosen from it."""
        return self._costs.setdefault((mode, batch_size), CallCosts())

    def input_specs(self) -> tuple:
        """(features, labels) PartitionSpecs from ``TPUConfig.input_partition_dims``."""
        tpu = self.config.tpu_config
        dims = tpu.input_partition_dims
        if not dims:
            return (None, None)

        def specs(d):
            if d is None:
                return None
            if isinstance(d, dict):
                return {k: specs(v) for k, v in d.items()}
            return partitioning.partition_spec_from_dims(
                d, num_cores_per_replica=tpu.num_cores_per_replica
            )

        return specs(dims[0]), specs(dims[1]) if len(dims) > 1 else None

    def unrolled(self, mode: str) -> bool:
        """Whether ``mode``'s loop is unrolled (``options.loop_unrolled``; for TRAIN, what
        ``options.unroll`` holds)."""
        return loop_unrolled(self.config.tpu_config, mode)

    def _get(self, key: tuple, build: Callable[[], Callable]) -> Callable:
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]
