"""TPUEstimator on JAX: one model_fn, compiled loops on every device.

Example:
  >>> import estimator
  >>> est = estimator.TPUEstimator(model_fn, model_dir="/tmp/run", train_batch_size=128)
  >>> est.train(input_fn, max_steps=1000)
"""

from ._compat import root_logging_untouched

with root_logging_untouched():
    from . import summary
    from .cluster.cluster import TPUClusterResolver
    from .config import InputPipelineConfig, RunConfig, TPUConfig
    from .context import get_global_step, padding_mask
    from .driver.host import TracedValueError
    from .driver.preemption import Preempted
    from .errors import (
        CheckpointError,
        CheckpointMismatchError,
        EstimatorError,
        NoCheckpointError,
    )
    from .export_output import ClassificationOutput, PredictOutput, RegressionOutput
    from .input_context import InputContext
    from .io.export import build_raw_serving_input_receiver_fn, load_saved_model
    from .io.inference import rewrite_for_inference, validate_inference_rewrite_for_variables
    from .io.lock import ModelDirInUseError
    from .parallel.outside_compilation import outside_compilation
    from .parallel.replica_context import ReduceOp, get_replica_context
    from .scaffold import Scaffold, WarmStartSettings, init_from_checkpoint
    from .spec import EstimatorSpec, ModeKeys, TPUEstimatorSpec
    from .strategy.device_assignment import DeviceAssignment
    from .strategy.strategy import PerReplica, TPUStrategy, get_strategy
    from .tpu_estimator import TPUEstimator
    from .train_and_evaluate import EvalSpec, TrainSpec, train_and_evaluate

__all__ = [
    "TPUClusterResolver",
    "CheckpointError",
    "CheckpointMismatchError",
    "EstimatorError",
    "ModelDirInUseError",
    "NoCheckpointError",
    "Preempted",
    "TracedValueError",
    "build_raw_serving_input_receiver_fn",
    "load_saved_model",
    "ClassificationOutput",
    "PredictOutput",
    "RegressionOutput",
    "outside_compilation",
    "rewrite_for_inference",
    "validate_inference_rewrite_for_variables",
    "DeviceAssignment",
    "PerReplica",
    "ReduceOp",
    "TPUStrategy",
    "get_replica_context",
    "get_strategy",
    "EstimatorSpec",
    "EvalSpec",
    "TrainSpec",
    "train_and_evaluate",
    "InputContext",
    "InputPipelineConfig",
    "ModeKeys",
    "RunConfig",
    "Scaffold",
    "TPUConfig",
    "TPUEstimator",
    "TPUEstimatorSpec",
    "WarmStartSettings",
    "get_global_step",
    "init_from_checkpoint",
    "padding_mask",
    "summary",
]
