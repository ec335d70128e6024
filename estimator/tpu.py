"""``from estimator import tpu``: the names of ``tf.estimator.tpu``, for ported programs.

A TF program names its estimator ``estimator`` (``estimator = tf.estimator.tpu.TPUEstimator(
...)``), which shadows this package inside the function that does it. Importing this module
instead keeps every such line unchanged but the namespace. Every name here is the same object
as ``estimator.<name>``, and ``bfloat16_scope()`` is TF's ``tf.tpu.bfloat16_scope``
(``estimator.engine.precision``).

Example:
  >>> from estimator import tpu
  >>> def main():
  ...     run_config = tpu.RunConfig(model_dir="/tmp/mnist",
  ...                                tpu_config=tpu.TPUConfig(iterations_per_loop=50))
  ...     estimator = tpu.TPUEstimator(model_fn=model_fn, config=run_config,
  ...                                  train_batch_size=1024, use_tpu=True)
  ...     estimator.train(input_fn=train_input_fn, max_steps=1000)
"""

from __future__ import annotations

from .core.config import InputPipelineConfig, RunConfig, TPUConfig
from .core.spec import TPUEstimatorSpec
from .engine.precision import bfloat16_scope
from .tpu_estimator import TPUEstimator

__all__ = [
    "InputPipelineConfig",
    "RunConfig",
    "TPUConfig",
    "TPUEstimator",
    "TPUEstimatorSpec",
    "bfloat16_scope",
]
