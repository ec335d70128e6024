"""What the train, evaluate and predict drivers work with, handed over by the estimator."""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

from jax.sharding import Mesh

from ..config import RunConfig
from ..data.feeder import Feeder
from ..engine.model import ModelFn
from ..engine.programs import Programs
from ..io.store import StateStore


@dataclasses.dataclass(frozen=True)
class Job:
    """The estimator's collaborators; the drivers get this, never the estimator itself.

    Attributes:
      config: the ``RunConfig`` (its ``model_dir`` is the estimator's).
      mesh: the ``("data", "model")`` mesh.
      model: the user's model_fn under its Flax root.
      programs: the compiled loops and the traced specs.
      store: checkpoints and the last in-memory training state.
      feeder: input pipelines and prefetching.
    """

    config: RunConfig
    mesh: Mesh
    model: ModelFn
    programs: Programs
    store: StateStore
    feeder: Feeder

    @property
    def model_dir(self) -> str:
        return self.config.model_dir

    @property
    def num_replicas(self) -> int:
        return self.mesh.shape["data"]

    def eval_dir(self, name: str | None = None) -> str:
        return os.path.join(self.model_dir, "eval" if not name else f"eval_{name}")


class TrainOutcome(NamedTuple):
    """How a ``train`` call ended.

    Attributes:
      step: the global step reached (and checkpointed).
      stopped_by_hook: a hook asked to stop (e.g. early stopping).
      trained: whether any step ran (False when max_steps was already reached or the input
        was exhausted before the first step).
      input_ended: training ended because the input did (not at its target or a stop).
    """

    step: int
    stopped_by_hook: bool = False
    trained: bool = True
    input_ended: bool = False
