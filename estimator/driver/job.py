"""What the train, evaluate and predict drivers work with, handed over by the estimator."""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

from jax.sharding import Mesh

from .. import storage
from ..core.config import RunConfig
from ..data.feeder import Feeder
from ..engine.model import ModelFn
from ..engine.options import StepOptions
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
      loop_choice: what ``iterations_per_loop="auto"`` chose, for later calls (``auto_loop``).
    """

    config: RunConfig
    mesh: Mesh
    model: ModelFn
    programs: Programs
    store: StateStore
    feeder: Feeder
    loop_choice: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def model_dir(self) -> str:
        return self.config.model_dir

    @property
    def options(self) -> StepOptions:
        """The train step's options, resolved once from the config and the mesh
        (``Programs.options``, ``engine/options.py``): read them here, never from the config."""
        return self.programs.options

    @property
    def num_replicas(self) -> int:
        return self.mesh.shape["data"]

    def eval_dir(self, name: str | None = None) -> str:
        return storage.join(self.model_dir, "eval" if not name else f"eval_{name}")


class EndReason(enum.StrEnum):
    """Why a ``train`` call ended (a ``str``: ``reason == "hook"`` works too)."""

    TARGET = "target"  # max_steps, steps or a hook's planned last step reached
    HOOK = "hook"  # a hook requested a stop (e.g. early stopping)
    LISTENER = "listener"  # a CheckpointSaverListener's after_save returned True
    INPUT_END = "input_end"  # the input ended before the target (or there was none)
    SIGNAL = "signal"  # SIGTERM or Ctrl-C (train raises once the checkpoint is committed)
    ALREADY_DONE = "already_done"  # nothing to do: the target was reached before the call


class TrainOutcome(NamedTuple):
    """How a ``train`` call ended.

    Attributes:
      step: the global step reached (and checkpointed).
      reason: why it ended (``EndReason``).

    Example:
      >>> TrainOutcome(500, EndReason.TARGET).reason == "target"
      True
    """

    step: int
    reason: EndReason
