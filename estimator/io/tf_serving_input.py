"""Serving inputs decoded by TF ops inside the TF SavedModel: encoded images (JPEG, PNG, ...).

TF programs serve image models from the encoded bytes; ResNet's and EfficientNet's
``image_serving_input_fn`` take a ``[None]`` ``tf.string`` placeholder ``image_bytes`` and
decode and resize inside the graph, so a client (TF Serving's REST API:
``{"instances": [{"b64": "<base64 JPEG>"}]}``) sends the file as it is. Here the exported JAX
computation takes the decoded images (its features); a ``TFServingInput`` adds the TF ops in
front of it in the TF SavedModel (``io/tf_saved_model.py``): every signature takes the
receiver tensors (``image_bytes``, ``tf.string``, any batch) and runs ``decode`` on each
element (``tf.map_fn``, as ResNet did) before calling the converted computation.

The portable export (``assets.extra/``, ``estimator.load_saved_model``) is unchanged: it takes
the decoded images. ``signature.json`` records the TF SavedModel's serving inputs under
``tf_serving_input``.

Example:
  >>> serving = image_bytes_input((224, 224), channels=3)
  >>> serving.receiver        # {'image_bytes': ((None,), 'string')}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from ..core.errors import EstimatorTypeError, EstimatorValueError

RESIZE_METHODS = ("bilinear", "nearest", "bicubic", "area", "lanczos3", "lanczos5", "mitchellcubic")


@dataclasses.dataclass(frozen=True)
class TFServingInput:
    """What the TF SavedModel's signatures take and how TF turns it into the features.

    Attributes:
      receiver: receiver tensor name -> (shape with ``None`` for the batch, TF dtype name).
      decode: ``decode(tf, element) -> feature`` for ONE element of the (single) receiver
        tensor: TF ops, run by ``tf.map_fn`` over the batch inside the SavedModel.
      feature: the image spec (``[1, H, W, C]`` shape and dtype) the decoded batch must have.
      feature_key: the features' dict key, or None when the features are the images alone.
      description: what ``signature.json`` records about the decoding.
    """

    receiver: Mapping[str, tuple[tuple, str]]
    decode: Callable[[Any, Any], Any]
    feature: Any
    feature_key: str | None
    description: Mapping[str, Any]

    def input_signature(self, tf: Any) -> dict:
        """The ``tf.TensorSpec`` s the serving signatures take, by name."""
        return {
            name: tf.TensorSpec(list(shape), tf.as_dtype(dtype), name=name)
            for name, (shape, dtype) in self.receiver.items()
        }

    def features(self, tf: Any, receiver: Mapping[str, Any]) -> Any:
        """The features (a batch) from the receiver tensors, with TF ops."""
        (name,) = self.receiver
        shape = [*self.feature.shape[1:]]
        dtype = tf.as_dtype(np.dtype(self.feature.dtype))

        def one(element):
            image = tf.cast(self.decode(tf, element), dtype)
            return tf.ensure_shape(image, shape)  # a preprocess_fn of the wrong size fails here

        images = tf.map_fn(one, receiver[name], fn_output_signature=tf.TensorSpec(shape, dtype))
        return images if self.feature_key is None else {self.feature_key: images}


def _size(image_size: Any) -> tuple[int, int]:
    size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    if len(size) != 2 or not all(isinstance(s, int) and s > 0 for s in size):
        raise EstimatorValueError(
            f"image_size must be an int or (height, width) of positive ints, got {image_size!r}"
        )
    return size


def image_bytes_input(
    image_size: Any,
    *,
    channels: int = 3,
    receiver_key: str = "image_bytes",
    feature_key: str | None = None,
    value_range: tuple[float, float] = (0.0, 255.0),
    resize_method: str = "bilinear",
    preprocess_fn: Callable[[Any], Any] | None = None,
    dtype: Any = np.float32,
) -> TFServingInput:
    """A ``TFServingInput`` decoding one encoded image per batch row (the arguments are
    ``build_image_serving_input_receiver_fn``'s)."""
    height, width = _size(image_size)
    if channels not in (1, 3, 4):
        raise EstimatorValueError(f"channels must be 1, 3 or 4, got {channels!r}")
    if resize_method not in RESIZE_METHODS:
        raise EstimatorValueError(
            f"resize_method must be one of {', '.join(RESIZE_METHODS)}; got {resize_method!r}"
        )
    if preprocess_fn is not None and not callable(preprocess_fn):
        raise EstimatorTypeError(f"preprocess_fn must be callable, got {preprocess_fn!r}")
    low, high = (float(v) for v in value_range)

    def decode(tf, image_bytes):
        if preprocess_fn is not None:  # the program's own TF preprocessing (ResNet's)
            return preprocess_fn(image_bytes)
        # decode_image reads JPEG, PNG, GIF (first frame) and BMP; expand_animations=False
        # gives every format a [H, W, C] shape
        image = tf.io.decode_image(image_bytes, channels=channels, expand_animations=False)
        image = tf.image.resize(tf.cast(image, tf.float32), [height, width], method=resize_method)
        return image * ((high - low) / 255.0) + low

    feature = jax.ShapeDtypeStruct((1, height, width, channels), np.dtype(dtype))
    described = {
        "receiver": {receiver_key: {"dtype": "string", "shape": ["b"]}},
        "decode": "preprocess_fn" if preprocess_fn is not None else "tf.io.decode_image",
        "image_size": [height, width],
        "channels": channels,
    }
    if preprocess_fn is None:
        described.update(resize_method=resize_method, value_range=[low, high])
    return TFServingInput(
        {receiver_key: ((None,), "string")}, decode, feature, feature_key, described
    )


__all__ = ["TFServingInput", "image_bytes_input"]
