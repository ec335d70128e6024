"""TF TPUEstimator's constructor arguments that have no meaning here.

Ported code passes them as TF's programs do; each is accepted with one warning, except the
ones that would change results if ignored, which are refused naming the replacement.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from .core.errors import EstimatorValueError

log = logging.getLogger("estimator")


_TF_ONLY_MEANING = {
    "eval_on_tpu": "evaluation runs on the estimator's devices, with the same results",
    "export_to_tpu": "export_saved_model writes one computation; choose its platforms with "
    "export_saved_model(platforms=...)",
    "export_to_cpu": "export_saved_model writes one computation; choose its platforms with "
    "export_saved_model(platforms=...)",
    "export_saved_model_api_version": "the export has one form (docs/export.md)",
    "batch_axis": "every input is split over replicas on its first (batch) dimension",
}


def tf_only_arguments(**given: Any) -> None:
    """TF's TPUEstimator arguments without a meaning here: one warning each when given;
    the ones that would change results if ignored are refused, naming the replacement."""
    spec = given.pop("embedding_config_spec")
    if spec is not None:
        raise EstimatorValueError(
            "TPUEstimator(embedding_config_spec=...) is not supported: the TPU embedding engine "
            "has no counterpart here; build the tables as flax.linen.Embed layers in model_fn "
            "(split them over devices with nn.with_partitioning, docs/sharding.md)"
        )
    axis = given.get("batch_axis")
    if axis is not None and any(a not in (0, None) for a in jax.tree.leaves(axis)):
        raise EstimatorValueError(
            f"TPUEstimator(batch_axis={axis!r}): inputs are split over replicas on their "
            "first dimension only; put the batch dimension first in input_fn"
        )
    for name, value in given.items():
        if value is not None:
            log.warning("TPUEstimator(%s=%r) ignored: %s", name, value, _TF_ONLY_MEANING[name])
