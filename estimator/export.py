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
from collections.abc import Callable
from typing import Any

import numpy as np

from .core.errors import EstimatorValueError
from .core.export_output import ClassificationOutput, PredictOutput, RegressionOutput
from .io import tf_serving_input as tf_serving_input_lib
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
      tf_serving_input: keyword-only; a TF-side decoding of the receiver tensors (what
        ``build_image_serving_input_receiver_fn`` makes): the TF SavedModel's signatures take
        the receiver tensors and decode them inside the SavedModel.
    """

    def __init__(
        self,
        features: Any,
        receiver_tensors: Any = None,
        receiver_tensors_alternatives: Any = None,
        *,
        tf_serving_input: tf_serving_input_lib.TFServingInput | None = None,
    ):
        if features is None:
            raise EstimatorValueError("ServingInputReceiver: features must be given")
        self.features = features
        self.receiver_tensors = receiver_tensors
        self.receiver_tensors_alternatives = receiver_tensors_alternatives
        self.tf_serving_input = tf_serving_input
        differs = receiver_tensors is not None and not _same(receiver_tensors, features)
        differs = differs and tf_serving_input is None
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


def build_image_serving_input_receiver_fn(
    image_size: int | tuple[int, int],
    *,
    channels: int = 3,
    receiver_key: str = "image_bytes",
    feature_key: str | None = None,
    value_range: tuple[float, float] = (0.0, 255.0),
    resize_method: str = "bilinear",
    preprocess_fn: Callable[[Any], Any] | None = None,
    dtype: Any = np.float32,
) -> Callable[[], ServingInputReceiver]:
    """A serving_input_receiver_fn that serves encoded images (ResNet's ``image_serving_input_fn``).

    The TF SavedModel that ``export_saved_model`` writes (with the ``tf`` extra) then takes
    ``receiver_key``: a ``[None]`` ``tf.string`` batch of encoded images (JPEG, PNG, GIF, BMP),
    and decodes each with TF ops inside the SavedModel (``tf.io.decode_image`` with
    ``channels``, ``tf.image.resize`` to ``image_size``, values mapped from [0, 255] to
    ``value_range``) before the exported model. TF Serving's REST request
    ``{"instances": [{"b64": "<base64 bytes>"}]}`` feeds it. model_fn receives float images
    ``[batch, height, width, channels]`` (``features`` itself, or ``features[feature_key]``),
    and the portable export (``estimator.load_saved_model``) takes those decoded images.

    Args:
      image_size: the model's input size, an int (square) or ``(height, width)``.
      channels: keyword-only; 1, 3 or 4 (decode_image converts to it).
      receiver_key: keyword-only; the signature's input name.
      feature_key: keyword-only; None: the features are the images; a str: a dict of one.
      value_range: keyword-only; what 0 and 255 become (``(0, 1)``, ``(-1, 1)``, ...).
      resize_method: keyword-only; a ``tf.image.resize`` method.
      preprocess_fn: keyword-only; the program's own TF preprocessing of ONE image's bytes
        (a scalar ``tf.string``) to a ``[height, width, channels]`` image, replacing the
        decode, resize and value mapping (ResNet's ``preprocess_image(image_bytes=...,
        is_training=False, image_size=...)``).
      dtype: keyword-only; the images' dtype.

    Example:
      >>> fn = estimator.export.build_image_serving_input_receiver_fn(224)
      >>> path = est.export_saved_model("/tmp/export", fn)
      >>> tf.saved_model.load(path).signatures["serving_default"](
      ...     image_bytes=tf.constant([open("cat.jpg", "rb").read()]))
    """
    serving = tf_serving_input_lib.image_bytes_input(
        image_size,
        channels=channels,
        receiver_key=receiver_key,
        feature_key=feature_key,
        value_range=value_range,
        resize_method=resize_method,
        preprocess_fn=preprocess_fn,
        dtype=dtype,
    )
    features = serving.feature if feature_key is None else {feature_key: serving.feature}

    def serving_input_receiver_fn() -> ServingInputReceiver:
        return ServingInputReceiver(
            features, {receiver_key: "tf.string [None]"}, tf_serving_input=serving
        )

    return serving_input_receiver_fn


__all__ = [
    "ClassificationOutput",
    "PredictOutput",
    "RegressionOutput",
    "ServingInputReceiver",
    "TensorServingInputReceiver",
    "build_image_serving_input_receiver_fn",
    "build_raw_serving_input_receiver_fn",
]
