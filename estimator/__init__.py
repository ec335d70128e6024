"""TPUEstimator on JAX: one model_fn, compiled loops on every device.

Example:
  >>> import estimator
  >>> est = estimator.TPUEstimator(model_fn, model_dir="/tmp/run", train_batch_size=128)
  >>> est.train(input_fn, max_steps=1000)
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from ._compat import root_logging_untouched

# The public names are imported on first use (PEP 562), not here: importing JAX takes
# seconds, and the command line (estimator.cli) must answer `--help` or report a mistyped
# flag without it. `estimator.TPUEstimator`, `from estimator import RunConfig` and
# `estimator.summary` work as if everything had been imported eagerly.
_EXPORTS = {
    ".cluster.cluster": ("TPUClusterResolver",),
    ".config": ("InputPipelineConfig", "RunConfig", "TPUConfig"),
    ".context": ("get_global_step", "padding_mask"),
    ".cross_shard_optimizer": ("CrossShardOptimizer",),
    ".engine.traced": ("TracedValueError",),
    ".driver.preemption": ("Preempted",),
    ".errors": (
        "CheckpointError",
        "CheckpointMismatchError",
        "EstimatorError",
        "NanLossDuringTrainingError",
        "NoCheckpointError",
    ),
    ".export_output": ("ClassificationOutput", "PredictOutput", "RegressionOutput"),
    ".input_context": ("InputContext",),
    ".io.export": ("build_raw_serving_input_receiver_fn", "load_saved_model"),
    ".io.checkpoint_utils": (
        "checkpoints_iterator",
        "latest_checkpoint",
        "list_variables",
        "load_variable",
    ),
    ".io.inference": ("rewrite_for_inference", "validate_inference_rewrite_for_variables"),
    ".io.lock": ("ModelDirInUseError",),
    ".io.variables": ("name_mask", "named_variables"),
    ".parallel.outside_compilation": ("outside_compilation",),
    ".parallel.replica_context": ("ReduceOp", "get_replica_context"),
    ".scaffold": ("Scaffold", "WarmStartSettings", "init_from_checkpoint"),
    ".spec": ("EstimatorSpec", "ModeKeys", "TPUEstimatorSpec"),
    ".strategy.device_assignment": ("DeviceAssignment",),
    ".strategy.strategy": ("PerReplica", "TPUStrategy", "get_strategy"),
    ".tpu_estimator": ("TPUEstimator",),
    ".train_and_evaluate": ("EvalSpec", "TrainSpec", "train_and_evaluate"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "ClassificationOutput",
    "CrossShardOptimizer",
    "DeviceAssignment",
    "EstimatorError",
    "EstimatorSpec",
    "EvalSpec",
    "InputContext",
    "InputPipelineConfig",
    "ModeKeys",
    "ModelDirInUseError",
    "NanLossDuringTrainingError",
    "NoCheckpointError",
    "PerReplica",
    "PredictOutput",
    "Preempted",
    "ReduceOp",
    "RegressionOutput",
    "RunConfig",
    "Scaffold",
    "TPUClusterResolver",
    "TPUConfig",
    "TPUEstimator",
    "TPUEstimatorSpec",
    "TPUStrategy",
    "TracedValueError",
    "TrainSpec",
    "WarmStartSettings",
    "build_raw_serving_input_receiver_fn",
    "checkpoints_iterator",
    "get_global_step",
    "get_replica_context",
    "get_strategy",
    "init_from_checkpoint",
    "latest_checkpoint",
    "list_variables",
    "load_saved_model",
    "load_variable",
    "name_mask",
    "named_variables",
    "outside_compilation",
    "padding_mask",
    "rewrite_for_inference",
    "summary",
    "train_and_evaluate",
    "validate_inference_rewrite_for_variables",
]


def __getattr__(name: str) -> Any:
    """A public name (or a submodule, e.g. ``estimator.summary``), imported on first use."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with root_logging_untouched():  # Orbax logs through absl while it is imported
        if name in _MODULE_OF:
            value = getattr(importlib.import_module(_MODULE_OF[name], __name__), name)
        else:
            try:
                value = importlib.import_module(f".{name}", __name__)
            except ModuleNotFoundError as e:
                if e.name != f"{__name__}.{name}":
                    raise
                raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Keeps a public name when its own submodule is imported.

    Importing ``estimator.train_and_evaluate`` (the module) makes Python set the package's
    attribute of that name to the module, which would hide the function of the same name;
    an eager ``from .train_and_evaluate import train_and_evaluate`` used to set it back.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if not (name in _MODULE_OF and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:  # the same names, for type checkers and editors
    from . import summary
    from .cluster.cluster import TPUClusterResolver
    from .config import InputPipelineConfig, RunConfig, TPUConfig
    from .context import get_global_step, padding_mask
    from .cross_shard_optimizer import CrossShardOptimizer
    from .driver.preemption import Preempted
    from .engine.traced import TracedValueError
    from .errors import (
        CheckpointError,
        CheckpointMismatchError,
        EstimatorError,
        NoCheckpointError,
    )
    from .export_output import ClassificationOutput, PredictOutput, RegressionOutput
    from .input_context import InputContext
    from .io.checkpoint_utils import (
        checkpoints_iterator,
        latest_checkpoint,
        list_variables,
        load_variable,
    )
    from .io.export import build_raw_serving_input_receiver_fn, load_saved_model
    from .io.inference import rewrite_for_inference, validate_inference_rewrite_for_variables
    from .io.lock import ModelDirInUseError
    from .io.variables import name_mask, named_variables
    from .parallel.outside_compilation import outside_compilation
    from .parallel.replica_context import ReduceOp, get_replica_context
    from .scaffold import Scaffold, WarmStartSettings, init_from_checkpoint
    from .spec import EstimatorSpec, ModeKeys, TPUEstimatorSpec
    from .strategy.device_assignment import DeviceAssignment
    from .strategy.strategy import PerReplica, TPUStrategy, get_strategy
    from .tpu_estimator import TPUEstimator
    from .train_and_evaluate import EvalSpec, TrainSpec, train_and_evaluate
