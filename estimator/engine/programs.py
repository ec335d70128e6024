"""The compiled programs of one estimator and what tracing model_fn taught.

``Programs`` builds each loop once per (kind, batch size) and keeps it, so a second
``evaluate`` or the evaluations between training rounds compile nothing. Tracing model_fn
records the spec of each mode (``spec(mode)``) and the variables' partition specs
(``var_specs``, known after the first trace), which later programs and restores need.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from ..config import RunConfig
from ..errors import EstimatorValueError
from ..parallel import partitioning
from ..spec import ModeKeys, TPUEstimatorSpec
from . import precision
from .loops import SpecHolder, make_eval_loop, make_init, make_train_loop
from .model import ModelFn


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

    def train(self, batch_size: int) -> Callable:
        """``loop(state, features, labels) -> (state, (losses, host, finite))`` over stacked
        steps (``finite``: per-step all-finite flags of the new state, ``loops.finite_flags``)."""
        return self._get(
            ("train", batch_size),
            lambda: make_train_loop(
                self.model,
                self.mesh,
                self.specs,
                batch_size=batch_size,
                unroll=self.unrolled(ModeKeys.TRAIN),
                skip_nonfinite=precision.skips_nonfinite(self.config),
                var_specs=self.var_specs,
                input_specs=self.input_specs(),
                shard_optimizer_state=self.config.tpu_config.shard_optimizer_state,
                shard_params=self.config.tpu_config.shard_params,
                compute_dtype=self.config.tpu_config.compute_dtype,
                num_microbatches=self.config.tpu_config.num_microbatches,
            ),
        )

    def infer(self, mode: str, batch_size: int) -> Callable:
        """The EVAL or PREDICT loop: ``loop(variables, step, rng, features, labels, mask)``."""
        if mode not in (ModeKeys.EVAL, ModeKeys.PREDICT):
            raise EstimatorValueError(f"infer() runs EVAL or PREDICT, got mode {mode!r}")
        return self._get(
            (mode, batch_size),
            lambda: make_eval_loop(
                self.model,
                self.mesh,
                self.specs,
                mode=mode,
                batch_size=batch_size,
                unroll=self.unrolled(mode),
                input_specs=self.input_specs(),
                compute_dtype=self.config.tpu_config.compute_dtype,
            ),
        )

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
        """Whether ``mode``'s loop is unrolled: ``TPUConfig.unroll_loops``, or for ``None``
        the training loop on CPU when it is short (<= 10 steps). XLA:CPU runs the gradient
        convolutions of a rolled training loop about 18x slower (jax-ml/jax#12868), but
        forward-only loops measured as fast rolled (the benchmark CNN, a ResNet), and a
        rolled loop compiles in the same time whatever its length, so evaluation and
        prediction stay rolled (docs/performance.md)."""
        tpu = self.config.tpu_config
        if tpu.unroll_loops is not None:
            return tpu.unroll_loops
        if mode != ModeKeys.TRAIN:
            return False
        return jax.default_backend() == "cpu" and tpu.iterations_per_loop <= 10

    def _get(self, key: tuple, build: Callable[[], Callable]) -> Callable:
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]
