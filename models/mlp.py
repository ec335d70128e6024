"""A multilayer perceptron and its model_fn: the default job (digits classification).

The model_fn shows the estimator used the way a user should: per-replica batch, the padding
mask in the loss, ``eval_metrics`` computed on the host, and a ``host_call`` writing summaries.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp
import optax

import estimator
import metrics


class MLP(nn.Module):
    """Dense layers with ReLU and dropout, then a linear classifier."""

    hidden: Sequence[int] = (256, 128)
    num_classes: int = 10
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, *, train: bool):
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.hidden):
            x = nn.relu(nn.Dense(width, name=f"dense_{i}")(x))
            if self.dropout:
                x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(self.num_classes, name="logits")(x)


def masked_cross_entropy(logits, labels):
    """Mean softmax cross-entropy over the real (unpadded) rows of this replica's batch."""
    mask = estimator.padding_mask()
    per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return (per_row * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def classification_metric_fn(labels, logits):
    """Host-side eval metrics from concatenated, unpadded arrays."""
    return {"accuracy": metrics.accuracy(labels, logits.argmax(-1))}


def summaries_host_fn(global_step, loss, learning_rate):
    """Runs on the host for every training step (thinned by host_call_every_n_steps)."""
    estimator.summary.scalar("train/loss", loss.mean(), step=int(global_step[0]))
    estimator.summary.scalar("train/learning_rate", learning_rate[0], step=int(global_step[0]))


def make_optimizer(params: dict) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer and learning-rate schedule that ``params`` names.

    ``params``: ``learning_rate``, ``decay_steps`` (cosine decay to 5%), ``weight_decay``,
    ``warmup_steps`` (linear warm-up, default 0) and ``optimizer``: ``"adamw"`` (default) or
    ``"momentum"`` (SGD, Nesterov momentum 0.9, decoupled weight decay);
    ``moving_average_decay`` (default 0: none) keeps an ``ExponentialMovingAverage`` of the
    weights (TF's ``num_updates`` rule) that evaluate, predict and export read.

    Raises:
      ValueError: an unknown ``params["optimizer"]``.
    """
    peak, decay = params["learning_rate"], max(int(params.get("decay_steps", 1000)), 1)
    warmup = int(params.get("warmup_steps", 0))
    if warmup > 0:
        lr = optax.warmup_cosine_decay_schedule(
            0.0, peak, warmup, max(decay, warmup + 1), end_value=0.05 * peak
        )
    else:
        lr = optax.cosine_decay_schedule(peak, decay, alpha=0.05)
    name, wd = params.get("optimizer", "adamw"), params.get("weight_decay", 0.0)
    if name == "adamw":
        tx = optax.adamw(lr, weight_decay=wd)
    elif name == "momentum":
        tx = optax.chain(optax.add_decayed_weights(wd), optax.sgd(lr, momentum=0.9, nesterov=True))
    else:
        raise ValueError(f"params['optimizer']={name!r}; expected 'adamw' or 'momentum'")
    decay = float(params.get("moving_average_decay", 0.0))
    if decay > 0:  # EfficientNet's recipe: TF's num_updates rule, the averages evaluated
        ema = estimator.ExponentialMovingAverage(decay, num_updates=True, use_for_eval=True)
        tx = ema.apply(tx)
    return tx, lr


def classifier_model_fn(module: nn.Module):
    """A model_fn for any module mapping ``features`` to class logits.

    Construct ``module`` inside your own model_fn (Flax modules bind to the estimator's scope
    where they are created; one built outside raises ``CallCompactUnboundModuleError``):

    Example:
      >>> def model_fn(features, labels, mode, params):
      ...     return classifier_model_fn(MLP(hidden=(64,)))(features, labels, mode, params)
    """

    def model_fn(features, labels, mode, params):
        train = mode == estimator.ModeKeys.TRAIN
        logits = module(features, train=train)
        if mode == estimator.ModeKeys.PREDICT:
            return estimator.TPUEstimatorSpec(
                mode,
                predictions={"class_ids": logits.argmax(-1), "logits": logits},
                export_outputs={"class_ids": logits.argmax(-1), "logits": logits},
            )
        loss = masked_cross_entropy(logits, labels)
        tx, lr = make_optimizer(params)
        step = estimator.get_global_step()
        host_call = None
        if train and params.get("write_summaries", True):
            host_call = (
                summaries_host_fn,
                [jnp.reshape(step, (1,)), jnp.reshape(loss, (1,)), jnp.reshape(lr(step), (1,))],
            )
        return estimator.TPUEstimatorSpec(
            mode,
            loss=loss,
            train_op=tx if train else None,
            eval_metrics=(classification_metric_fn, [labels, logits]),
            host_call=host_call,
            predictions={"class_ids": logits.argmax(-1)},
        )

    return model_fn


def model_fn(features, labels, mode, params):
    """The MLP on flat features; ``params``: hidden, num_classes, dropout, learning_rate."""
    module = MLP(
        hidden=tuple(params.get("hidden", (256, 128))),
        num_classes=params.get("num_classes", 10),
        dropout=params.get("dropout", 0.0),
    )
    return classifier_model_fn(module)(features, labels, mode, params)
