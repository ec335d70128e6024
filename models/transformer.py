"""A decoder-only Transformer language model (pre-LayerNorm, GPT-style) and its model_fn.

Example:
  >>> est = estimator.TPUEstimator(models.transformer.model_fn, train_batch_size=64,
  ...                              eval_batch_size=64, predict_batch_size=64,
  ...                              params={"num_layers": 4, "d_model": 256, "num_heads": 4,
  ...                                      "learning_rate": 1e-3})
  >>> est.evaluate(models.text.char_lm(config)["eval"])   # {'perplexity': ..., 'loss': ...}

Features are int32 token ids ``[batch, seq_len]`` and labels the next tokens (same shape);
see ``models.text`` for the character-level data. The loss is the mean per-token cross
entropy over real (unpadded) rows; ``eval_metrics`` report ``perplexity`` = exp(mean
per-token loss over every evaluated token) and next-token ``accuracy``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

import estimator
import metrics

from .mlp import make_optimizer, summaries_host_fn
from .text import VOCAB_SIZE


@dataclasses.dataclass(frozen=True, eq=False)
class Perplexity(metrics.Mean):
    """exp of the mean of per-token losses (natural log); merges like ``metrics.mean``.

    Example:
      >>> Perplexity.from_model_output(np.log([[2.0, 8.0]])).compute()   # exp(mean) = 4.0
    """

    def compute(self) -> float:
        return math.exp(super().compute())


class DecoderBlock(nn.Module):
    """Causal self-attention and an MLP, each pre-LayerNorm with a residual connection."""

    num_heads: int
    mlp_dim: int
    dropout: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mask, *, train: bool):
        y = nn.LayerNorm(dtype=self.dtype, name="ln_attn")(x)
        y = nn.MultiHeadDotProductAttention(
            self.num_heads,
            dtype=self.dtype,
            dropout_rate=self.dropout,
            deterministic=not train,
            name="attn",
        )(y, mask=mask)
        x = x + nn.Dropout(self.dropout, deterministic=not train)(y)
        y = nn.LayerNorm(dtype=self.dtype, name="ln_mlp")(x)
        y = nn.gelu(nn.Dense(self.mlp_dim, dtype=self.dtype, name="mlp_in")(y))
        y = nn.Dense(x.shape[-1], dtype=self.dtype, name="mlp_out")(y)
        return x + nn.Dropout(self.dropout, deterministic=not train)(y)


class TransformerLM(nn.Module):
    """Token + learned position embeddings, ``num_layers`` decoder blocks, tied output.

    Attributes:
      vocab_size: token ids are in ``[0, vocab_size)`` (256: bytes).
      num_layers, num_heads, d_model, mlp_dim: the size.
      max_len: the longest sequence (size of the position table).
      dropout: on embeddings, attention weights and residual branches (TRAIN only).
      dtype: computation dtype; params stay float32.

    Example:
      >>> logits = TransformerLM(num_layers=2, d_model=64, num_heads=4)(tokens, train=False)
    """

    vocab_size: int = VOCAB_SIZE
    num_layers: int = 4
    num_heads: int = 4
    d_model: int = 256
    mlp_dim: int = 1024
    max_len: int = 256
    dropout: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens, *, train: bool):
        if tokens.ndim != 2 or tokens.shape[1] > self.max_len:
            raise ValueError(
                f"TransformerLM expects tokens [batch, seq_len <= max_len={self.max_len}], "
                f"got {tokens.shape}"
            )
        embed = nn.Embed(
            self.vocab_size, self.d_model, name="embed", embedding_init=nn.initializers.normal(0.02)
        )
        pos = self.param("pos_embed", nn.initializers.normal(0.02), (self.max_len, self.d_model))
        x = embed(tokens) + pos[None, : tokens.shape[1]]
        x = nn.Dropout(self.dropout, deterministic=not train)(x).astype(self.dtype)
        mask = nn.make_causal_mask(tokens)
        for i in range(self.num_layers):
            x = DecoderBlock(
                self.num_heads, self.mlp_dim, self.dropout, self.dtype, name=f"block_{i}"
            )(x, mask, train=train)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_final")(x)
        return embed.attend(x.astype(jnp.float32))


def _module(params: dict) -> TransformerLM:
    d_model = int(params.get("d_model", 256))
    return TransformerLM(
        vocab_size=int(params.get("vocab_size", VOCAB_SIZE)),
        num_layers=int(params.get("num_layers", 4)),
        num_heads=int(params.get("num_heads", 4)),
        d_model=d_model,
        mlp_dim=int(params.get("mlp_dim", 4 * d_model)),
        max_len=int(params.get("max_len", 256)),
        dropout=float(params.get("dropout", 0.0)),
        dtype=jnp.dtype(params.get("dtype", "float32")),
    )


def lm_metric_fn(labels, token_loss, next_token):
    """Host-side eval metrics from concatenated, unpadded ``[N, seq_len]`` arrays."""
    return {
        "perplexity": Perplexity.from_model_output(token_loss),
        "accuracy": metrics.accuracy(labels, next_token),
    }


def lm_host_fn(global_step, loss, learning_rate):
    """Training summaries: loss, learning rate and perplexity."""
    summaries_host_fn(global_step, loss, learning_rate)
    estimator.summary.scalar(
        "train/perplexity", float(np.exp(loss.mean())), step=int(global_step[0])
    )


def model_fn(features, labels, mode, params):
    """Next-token prediction. ``params``: num_layers, num_heads, d_model, mlp_dim, max_len,
    dropout, dtype, grad_clip (global norm, default 1.0) and the optimizer fields of
    ``models.mlp.make_optimizer`` (``warmup_steps`` recommended)."""
    train = mode == estimator.ModeKeys.TRAIN
    logits = _module(params)(features, train=train)
    next_token = logits.argmax(-1)
    if mode == estimator.ModeKeys.PREDICT:
        outputs = {"next_token": next_token, "logits": logits}
        return estimator.TPUEstimatorSpec(mode, predictions=outputs, export_outputs=outputs)
    token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    mask = estimator.padding_mask()
    loss = (token_loss.mean(-1) * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    tx, lr = make_optimizer(params)
    tx = optax.chain(optax.clip_by_global_norm(params.get("grad_clip", 1.0)), tx)
    host_call = None
    if train and params.get("write_summaries", True):
        step = estimator.get_global_step()
        host_call = (
            lm_host_fn,
            [jnp.reshape(step, (1,)), jnp.reshape(loss, (1,)), jnp.reshape(lr(step), (1,))],
        )
    return estimator.TPUEstimatorSpec(
        mode,
        loss=loss,
        train_op=tx if train else None,
        host_call=host_call,
        eval_metrics=(lm_metric_fn, [labels, token_loss, next_token]),
    )


__all__ = ["DecoderBlock", "Perplexity", "TransformerLM", "lm_metric_fn", "model_fn"]
