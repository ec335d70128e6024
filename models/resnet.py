"""ResNet v1.5 (18/34/50/101/152) with optional cross-replica BatchNorm, and its model_fn.

Example:
  >>> est = estimator.TPUEstimator(models.resnet.model_fn, train_batch_size=256,
  ...                              params={"depth": 50, "num_classes": 1000,
  ...                                      "cross_replica_bn": True, "learning_rate": 0.1})

BatchNorm statistics live in the ``batch_stats`` collection: mutable in TRAIN (the estimator
averages them over replicas after each step), frozen in EVAL/PREDICT. With
``cross_replica_bn=True`` the batch statistics of a TRAIN step are computed over the global
batch (``nn.BatchNorm(axis_name="data")``: the estimator runs model_fn manual over the
``"data"`` mesh axis); otherwise each replica normalises with its own rows, as TPUEstimator's
ResNet did by default.

``stem="cifar"`` is the 3x3/stride-1 stem without max-pool for 32x32 images;
``stem="imagenet"`` the 7x7/stride-2 convolution and 3x3 max-pool.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from .mlp import classifier_model_fn

ModuleDef = Any

STAGES: dict[int, tuple[int, ...]] = {
    18: (2, 2, 2, 2),
    34: (3, 4, 6, 3),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
}


class BasicBlock(nn.Module):
    """Two 3x3 convolutions (ResNet-18/34); the last BatchNorm's scale starts at zero."""

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters, (3, 3))(y))
        if x.shape != y.shape:
            x = self.norm(name="norm_proj")(
                self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(x)
            )
        return nn.relu(x + y)


class BottleneckBlock(nn.Module):
    """1x1 -> 3x3 (strided, v1.5) -> 1x1 x4 convolutions (ResNet-50 and deeper)."""

    filters: int
    conv: ModuleDef
    norm: ModuleDef
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        y = nn.relu(self.norm()(self.conv(self.filters, (1, 1))(x)))
        y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(
            self.conv(self.filters * 4, (1, 1))(y)
        )
        if x.shape != y.shape:
            x = self.norm(name="norm_proj")(
                self.conv(self.filters * 4, (1, 1), self.strides, name="conv_proj")(x)
            )
        return nn.relu(x + y)


class ResNet(nn.Module):
    """A ResNet classifier over NHWC images.

    Attributes:
      stage_sizes: blocks per stage (see ``STAGES``).
      bottleneck: bottleneck blocks (ResNet-50+) instead of basic blocks.
      num_classes: logits per example.
      num_filters: width of the first stage (doubled each stage).
      stem: ``"imagenet"`` or ``"cifar"`` (see the module docstring).
      cross_replica_bn: BatchNorm statistics over the global batch (``axis_name="data"``).
      bn_momentum: running-average momentum of BatchNorm.
      dtype: computation dtype (``jnp.bfloat16`` on TPU/GPU); params stay float32.

    Example:
      >>> logits = ResNet(STAGES[18], num_classes=10, stem="cifar")(images, train=True)
    """

    stage_sizes: Sequence[int]
    bottleneck: bool = False
    num_classes: int = 1000
    num_filters: int = 64
    stem: str = "imagenet"
    cross_replica_bn: bool = False
    bn_momentum: float = 0.9
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, *, train: bool):
        if x.ndim != 4:
            raise ValueError(
                f"ResNet expects images [batch, height, width, channels], got {x.shape}"
            )
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=self.bn_momentum,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name="data" if self.cross_replica_bn else None,
        )
        x = self._stem(x.astype(self.dtype), conv, norm)
        block: Callable = BottleneckBlock if self.bottleneck else BasicBlock
        for i, size in enumerate(self.stage_sizes):
            for j in range(size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = block(
                    self.num_filters * 2**i,
                    conv=conv,
                    norm=norm,
                    strides=strides,
                    name=f"stage{i + 1}_block{j + 1}",
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=jnp.float32, name="logits")(x.astype(jnp.float32))

    def _stem(self, x, conv, norm):
        if self.stem == "cifar":
            x = conv(self.num_filters, (3, 3), name="conv_init")(x)
            return nn.relu(norm(name="bn_init")(x))
        if self.stem != "imagenet":
            raise ValueError(f"ResNet stem={self.stem!r}; expected 'imagenet' or 'cifar'")
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        return nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")


def resnet(depth: int, *, stage_sizes: Sequence[int] | None = None, **kwargs) -> ResNet:
    """``ResNet`` of a standard depth (18, 34, 50, 101, 152).

    Args:
      depth: picks the block type (bottleneck from 50 on) and the blocks per stage.
      stage_sizes: blocks per stage instead of the depth's (e.g. ``(1, 1, 1, 1)`` for a
        quick test of the same block type); ``None`` uses ``STAGES[depth]``.
      **kwargs: the other ``ResNet`` attributes.

    Raises:
      ValueError: an unknown ``depth``.
    """
    if depth not in STAGES:
        raise ValueError(f"ResNet depth={depth!r}; expected one of {sorted(STAGES)}")
    stages = STAGES[depth] if stage_sizes is None else tuple(int(n) for n in stage_sizes)
    return ResNet(stages, bottleneck=depth >= 50, **kwargs)


def model_fn(features, labels, mode, params):
    """ResNet on image features.

    ``params``: depth, stage_sizes (``None``: the depth's), num_classes, num_filters, stem,
    cross_replica_bn, bn_momentum, dtype (``"float32"`` or ``"bfloat16"``), plus the optimizer
    fields of ``models.mlp.make_optimizer`` (``optimizer="momentum"`` for the usual SGD recipe).
    """
    module = resnet(
        int(params.get("depth", 50)),
        stage_sizes=params.get("stage_sizes"),
        num_classes=params.get("num_classes", 1000),
        num_filters=params.get("num_filters", 64),
        stem=params.get("stem", "imagenet"),
        cross_replica_bn=bool(params.get("cross_replica_bn", False)),
        bn_momentum=params.get("bn_momentum", 0.9),
        dtype=jnp.dtype(params.get("dtype", "float32")),
    )
    return classifier_model_fn(module)(features, labels, mode, params)
