"""A small convolutional classifier and its model_fn (digits as 8x8x1 images).

Example:
  >>> est = estimator.TPUEstimator(models.cnn.model_fn, params={"features": (32, 64),
  ...                              "learning_rate": 3e-3}, train_batch_size=128, ...)

Convolutions inside a rolled ``lax.scan`` are about 18x slower on XLA:CPU
(jax-ml/jax#12868), so CPU jobs should set ``TPUConfig(unroll_loops=True)`` with a small
``iterations_per_loop`` (``configs/digits_cnn.py`` does).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn

from .mlp import classifier_model_fn


class CNN(nn.Module):
    """Conv3x3-ReLU-maxpool2x2 per entry of ``features``, then a dense layer and the logits.

    Example:
      >>> logits = CNN(features=(32, 64), num_classes=10)(images, train=False)  # [B, 10]
    """

    features: Sequence[int] = (32, 64)
    dense: int = 128
    num_classes: int = 10
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, *, train: bool):
        if x.ndim != 4:
            raise ValueError(f"CNN expects images [batch, height, width, channels], got {x.shape}")
        for i, width in enumerate(self.features):
            x = nn.relu(nn.Conv(width, (3, 3), name=f"conv_{i}")(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2), padding="SAME")
        x = nn.relu(nn.Dense(self.dense, name="dense")(x.reshape(x.shape[0], -1)))
        if self.dropout:
            x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(self.num_classes, name="logits")(x)


def model_fn(features, labels, mode, params):
    """The CNN on image features; ``params``: features, dense, num_classes, dropout, plus the
    optimizer fields of ``models.mlp.make_optimizer``."""
    module = CNN(
        features=tuple(params.get("features", (32, 64))),
        dense=params.get("dense", 128),
        num_classes=params.get("num_classes", 10),
        dropout=params.get("dropout", 0.0),
    )
    return classifier_model_fn(module)(features, labels, mode, params)
