"""How the compiled train step is built: ``StepOptions``, resolved once from the config and
the mesh.

``Programs`` resolves it when first asked (``Programs.options``; the drivers read it as
``job.options``), and everything that decides something about the step reads it there: the
loops (``make_train_loop``), the fresh and restored state (``engine/state.py``,
``io/restore.py``), the drivers' hooks and the start-up line. Nothing else re-derives a
decision from ``TPUConfig``.

The rule for a new train-step option: it touches its config field, one ``StepOptions`` field
(set in ``StepOptions.of``), its own module, and one call site in the step. A new signature
parameter, a second reading of the config or a copy of a predicate is the sign that it does
not.

Example:
  >>> tpu = TPUConfig(compute_dtype="float16", num_microbatches=4, shard_params=True)
  >>> options = StepOptions.of(RunConfig(tpu_config=tpu), make_mesh())   # 8 replicas
  >>> options.policy.loss_scaled, options.skip_nonfinite, options.sharded_state
  (True, True, True)
  >>> loop = make_train_loop(model, mesh, holder, options, batch_size=16)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from ..core.config import RunConfig
from ..core.spec import ModeKeys
from ..parallel.mesh import DATA
from .precision import Policy


def loop_unrolled(tpu_config: Any, mode: str) -> bool:
    """Whether ``mode``'s loop is unrolled: ``TPUConfig.unroll_loops``, or for ``None`` the
    training loop on CPU when it is short (<= 10 steps). XLA:CPU runs the gradient
    convolutions of a rolled training loop about 18x slower (jax-ml/jax#12868), but
    forward-only loops measured as fast rolled (the benchmark CNN, a ResNet), and a rolled
    loop compiles in the same time whatever its length, so evaluation and prediction stay
    rolled (docs/performance.md)."""
    if tpu_config.unroll_loops is not None:
        return tpu_config.unroll_loops
    if mode != ModeKeys.TRAIN:
        return False
    return jax.default_backend() == "cpu" and tpu_config.iterations_per_loop <= 10


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The train step's decisions (the defaults: float32, one micro-batch, replicated state).

    Attributes:
      policy: the compute-dtype ``precision.Policy``; ``policy.loss_scaled`` with float16.
      num_microbatches: micro-batches per replica and step (``engine/microbatch.py``).
      skip_nonfinite: a step whose loss, gradient or new state is not finite is skipped and
        counted: ``RunConfig.skip_nonfinite_steps``, or implied by loss scaling.
      sharded_state: the optimizer state is split over ``"data"`` (ZeRO; ``shard_params`` or
        ``shard_optimizer_state`` with more than one replica).
      sharded_params: the parameters are split over ``"data"`` too (FSDP; ``shard_params``
        with more than one replica).
      unroll: the train loop's ``lax.scan`` is unrolled (``loop_unrolled``).
    """

    policy: Policy = dataclasses.field(default_factory=Policy)
    num_microbatches: int = 1
    skip_nonfinite: bool = False
    sharded_state: bool = False
    sharded_params: bool = False
    unroll: bool = False

    @classmethod
    def of(cls, config: RunConfig, mesh: Mesh) -> StepOptions:
        """The options ``config`` asks for on ``mesh``."""
        tpu = config.tpu_config
        policy = Policy(tpu.compute_dtype)
        split = mesh.shape[DATA] > 1
        return cls(
            policy=policy,
            num_microbatches=tpu.num_microbatches,
            skip_nonfinite=bool(config.skip_nonfinite_steps) or policy.loss_scaled,
            sharded_state=bool(tpu.shard_optimizer_state or tpu.shard_params) and split,
            sharded_params=bool(tpu.shard_params) and split,
            unroll=loop_unrolled(tpu, ModeKeys.TRAIN),
        )

    def keeps_input(self, per_step_flags: bool) -> bool:
        """Whether a train program keeps (does not donate) its input state. The per-step
        program donates it. The per-call one keeps it for a replay (a non-finite result is
        run again from it with per-step flags to find the step) unless non-finite steps are
        skipped: then a finite input state gives a finite result, so only the state a call
        starts from can be the culprit."""
        return not (per_step_flags or self.skip_nonfinite)
