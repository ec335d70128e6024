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

from .core._compat import root_logging_untouched

# The public names are imported on first use (PEP 562), not here: importing JAX takes
# seconds, and the command line (estimator.cli) must answer `--help` or report a mistyped
# flag without it. `estimator.TPUEstimator`, `from estimator import RunConfig` and
# `estimator.summary` work as if everything had been imported eagerly.
_EXPORTS = {
    ".cluster.cluster": ("TPUClusterResolver",),
    ".core.config": ("InputPipelineConfig", "RunConfig", "TPUConfig"),
    ".core.context": ("get_global_step", "get_or_create_global_step", "padding_mask"),
    ".parallel.cross_shard_optimizer": ("CrossShardOptimizer",),
    ".engine.multi_loss": ("group", "minimize"),
    ".engine.scopes": ("AUTO_REUSE", "get_variable", "variable_scope"),
    ".engine.traced": ("TracedValueError",),
    ".driver.preemption": ("Preempted",),
    ".core.errors": (
        "CheckpointError",
        "CheckpointMismatchError",
        "EstimatorError",
        "NanLossDuringTrainingError",
        "NoCheckpointError",
    ),
    ".core.export_output": ("ClassificationOutput", "PredictOutput", "RegressionOutput"),
    ".core.protos": ("ConfigProto", "GraphOptions", "rewriter_config_pb2"),
    ".exporters": ("BestExporter", "Exporter", "FinalExporter", "LatestExporter"),
    ".core.input_context": ("InputContext",),
    ".io.export": ("build_raw_serving_input_receiver_fn", "load_saved_model"),
    ".io.checkpoint_utils": (
        "_load_global_step_from_checkpoint_dir",  # TF's private name, kept for ported mains
        "checkpoints_iterator",
        "latest_checkpoint",
        "list_variables",
        "load_global_step",
        "load_variable",
    ),
    ".io.inference": ("rewrite_for_inference", "validate_inference_rewrite_for_variables"),
    ".io.lock": ("ModelDirInUseError",),
    ".io.variables": ("name_mask", "named_variables"),
    ".weights.moving_average": ("ExponentialMovingAverage", "control_dependencies"),
    ".parallel.outside_compilation": ("outside_compilation",),
    ".parallel.replica_context": ("ReduceOp", "get_replica_context"),
    ".core.saver": ("Saver",),
    ".weights.scaffold": ("Scaffold", "WarmStartSettings", "init_from_checkpoint"),
    ".core.spec": ("EstimatorSpec", "ModeKeys", "TPUEstimatorSpec"),
    ".strategy.device_assignment": ("DeviceAssignment",),
    ".strategy.strategy": ("PerReplica", "TPUStrategy", "get_strategy"),
    ".tpu_estimator": ("TPUEstimator",),
    ".weights.trainable": (
        "GraphKeys",
        "get_collection",
        "global_variables",
        "trainable_variables",
    ),
    ".train_and_evaluate": ("EvalSpec", "TrainSpec", "train_and_evaluate"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
# Submodules that are public names themselves (``estimator.summary.scalar``), and where they live.
_SUBMODULES = {"errors": ".core.errors", "export": ".export", "summary": ".core.summary"}
# Derived from the table: one list of public names (the TYPE_CHECKING block at the end must
# import the same names from the same modules; tests/estimator/architecture_test.py checks it).
# A TF private name kept for ported code (``_load_global_step_from_checkpoint_dir``) resolves
# like the others but stays out of ``__all__``.
__all__ = sorted(n for n in [*_MODULE_OF, *_SUBMODULES] if not n.startswith("_"))


def __getattr__(name: str) -> Any:
    """A public name (or a submodule, e.g. ``estimator.summary``), imported on first use."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with root_logging_untouched():  # Orbax logs through absl while it is imported
        if name in _MODULE_OF:
            value = getattr(importlib.import_module(_MODULE_OF[name], __name__), name)
        else:
            try:
                value = importlib.import_module(_SUBMODULES.get(name, f".{name}"), __name__)
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


if TYPE_CHECKING:  # _EXPORTS spelled out for type checkers (``X as X``: re-exported)
    from . import export as export
    from .cluster.cluster import TPUClusterResolver as TPUClusterResolver
    from .core import errors as errors
    from .core import summary as summary
    from .core.config import InputPipelineConfig as InputPipelineConfig
    from .core.config import RunConfig as RunConfig
    from .core.config import TPUConfig as TPUConfig
    from .core.context import get_global_step as get_global_step
    from .core.context import get_or_create_global_step as get_or_create_global_step
    from .core.context import padding_mask as padding_mask
    from .core.errors import CheckpointError as CheckpointError
    from .core.errors import CheckpointMismatchError as CheckpointMismatchError
    from .core.errors import EstimatorError as EstimatorError
    from .core.errors import NanLossDuringTrainingError as NanLossDuringTrainingError
    from .core.errors import NoCheckpointError as NoCheckpointError
    from .core.export_output import ClassificationOutput as ClassificationOutput
    from .core.export_output import PredictOutput as PredictOutput
    from .core.export_output import RegressionOutput as RegressionOutput
    from .core.input_context import InputContext as InputContext
    from .core.protos import ConfigProto as ConfigProto
    from .core.protos import GraphOptions as GraphOptions
    from .core.protos import rewriter_config_pb2 as rewriter_config_pb2
    from .core.saver import Saver as Saver
    from .core.spec import EstimatorSpec as EstimatorSpec
    from .core.spec import ModeKeys as ModeKeys
    from .core.spec import TPUEstimatorSpec as TPUEstimatorSpec
    from .driver.preemption import Preempted as Preempted
    from .engine.multi_loss import group as group
    from .engine.multi_loss import minimize as minimize
    from .engine.scopes import AUTO_REUSE as AUTO_REUSE
    from .engine.scopes import get_variable as get_variable
    from .engine.scopes import variable_scope as variable_scope
    from .engine.traced import TracedValueError as TracedValueError
    from .exporters import BestExporter as BestExporter
    from .exporters import Exporter as Exporter
    from .exporters import FinalExporter as FinalExporter
    from .exporters import LatestExporter as LatestExporter
    from .io.checkpoint_utils import (
        _load_global_step_from_checkpoint_dir as _load_global_step_from_checkpoint_dir,
    )
    from .io.checkpoint_utils import checkpoints_iterator as checkpoints_iterator
    from .io.checkpoint_utils import latest_checkpoint as latest_checkpoint
    from .io.checkpoint_utils import list_variables as list_variables
    from .io.checkpoint_utils import load_global_step as load_global_step
    from .io.checkpoint_utils import load_variable as load_variable
    from .io.export import (
        build_raw_serving_input_receiver_fn as build_raw_serving_input_receiver_fn,
    )
    from .io.export import load_saved_model as load_saved_model
    from .io.inference import rewrite_for_inference as rewrite_for_inference
    from .io.inference import (
        validate_inference_rewrite_for_variables as validate_inference_rewrite_for_variables,
    )
    from .io.lock import ModelDirInUseError as ModelDirInUseError
    from .io.variables import name_mask as name_mask
    from .io.variables import named_variables as named_variables
    from .parallel.cross_shard_optimizer import CrossShardOptimizer as CrossShardOptimizer
    from .parallel.outside_compilation import outside_compilation as outside_compilation
    from .parallel.replica_context import ReduceOp as ReduceOp
    from .parallel.replica_context import get_replica_context as get_replica_context
    from .strategy.device_assignment import DeviceAssignment as DeviceAssignment
    from .strategy.strategy import PerReplica as PerReplica
    from .strategy.strategy import TPUStrategy as TPUStrategy
    from .strategy.strategy import get_strategy as get_strategy
    from .tpu_estimator import TPUEstimator as TPUEstimator
    from .train_and_evaluate import EvalSpec as EvalSpec
    from .train_and_evaluate import TrainSpec as TrainSpec
    from .train_and_evaluate import train_and_evaluate as train_and_evaluate
    from .weights.moving_average import ExponentialMovingAverage as ExponentialMovingAverage
    from .weights.moving_average import control_dependencies as control_dependencies
    from .weights.scaffold import Scaffold as Scaffold
    from .weights.scaffold import WarmStartSettings as WarmStartSettings
    from .weights.scaffold import init_from_checkpoint as init_from_checkpoint
    from .weights.trainable import GraphKeys as GraphKeys
    from .weights.trainable import get_collection as get_collection
    from .weights.trainable import global_variables as global_variables
    from .weights.trainable import trainable_variables as trainable_variables
