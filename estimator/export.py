"""``estimator.export``: TF's ``tf.estimator.export`` namespace (serving inputs and outputs).

A ported ``serving_input_receiver_fn`` returns ``export.ServingInputReceiver(features,
receiver_tensors)`` and model_fn's ``export_outputs`` hold ``export.PredictOutput(...)``;
both work as TF writes them, with the namespace changed. The estimator's method stays
``est.export_saved_model`` (this module is only the namespace; the export itself is
``estimator/driver/export.py``, its format ``estimator/io/export.py``).

Example:
  >>> def serving_input_receiver_fn():
  ...     images = jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)
  ...     return estimator.export.ServingInputReceiver(images, {"images": images})
"""

from __future__ import annotations

import logging
from typing import Any

from .errors import EstimatorValueError
from .export_output import ClassificationOutput, PredictOutput, RegressionOutput
from .io.export import build_raw_serving_input_receiver_fn

log = logging.getLogger("estimator")


class ServingInputReceiver:
    """TF's ``ServingInputReceiver``: the features the exported model_fn receives.

    Args:
      features: what model_fn gets in PREDICT mode, as shapes: an example array or a
        ``jax.ShapeDtypeStruct`` with a leading batch dimension (any size; the export serves
        any batch), or a dict of them.
      receiver_tensors: TF's serving placeholders, from which TF computed ``features`` in
        the graph. Here the export's inputs are the features themselves (preprocessing such
        as decoding image bytes runs in the client); receiver tensors other than the
        features are accepted with one warning saying so.
      receiver_tensors_alternatives: TF's alternative input signatures; accepted with the
        same warning.
    """

    def __init__(
        self, features: Any, receiver_tensors: Any = None, receiver_tensors_alternatives: Any = None
    ):
        if features is None:
            raise EstimatorValueError("ServingInputReceiver: features must be given")
        self.features = features
        self.receiver_tensors = receiver_tensors
        self.receiver_tensors_alternatives = receiver_tensors_alternatives
        differs = receiver_tensors is not None and not _same(receiver_tensors, features)
        if differs or receiver_tensors_alternatives is not None:
            log.warning(
                "ServingInputReceiver: the export's inputs are its features %s; "
                "receiver_tensors%s are not served (TF's in-graph preprocessing from "
                "them runs in the client here)",
                _describe(features),
                " and receiver_tensors_alternatives" if receiver_tensors_alternatives else "",
            )


def _same(receiver_tensors: Any, features: Any) -> bool:
    """Whether the receiver tensors are the features (TF's common ``{name: features}``)."""
    if receiver_tensors is features:
        return True
    if isinstance(receiver_tensors, dict):
        if isinstance(features, dict):
            return receiver_tensors.keys() == features.keys() and all(
                receiver_tensors[k] is features[k] for k in features
            )
        return len(receiver_tensors) == 1 and next(iter(receiver_tensors.values())) is features
    return False


def _describe(features: Any) -> str:
    if isinstance(features, dict):
        return str(sorted(features))
    return f"(one input, shape {tuple(getattr(features, 'shape', ()))})"


TensorServingInputReceiver = ServingInputReceiver  # TF's single-tensor spelling


__all__ = [
    "ClassificationOutput",
    "PredictOutput",
    "RegressionOutput",
    "ServingInputReceiver",
    "TensorServingInputReceiver",
    "build_raw_serving_input_receiver_fn",
]
