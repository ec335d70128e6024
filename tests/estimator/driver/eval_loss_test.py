"""The evaluation loss over exactly the real rows (``driver/eval_loss.py``).

The reference is the plain numpy sum of per-row losses over the real rows. Each replica's
loss is built from those per-row losses as each kind of model_fn would return it: the mean
over its real rows (a masked loss), or the mean over all its rows, padding included, plus a
constant (a TF-style plain ``mean()`` with a regulariser).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from estimator.driver import eval_loss
from estimator.parallel.mesh import make_mesh

R, B = 4, 3  # replicas, rows per replica
PAD_LOSS = 0.7  # the loss of a padding row (all-zero features)
CONSTANT = 0.25  # e.g. a weight penalty added to every replica's loss


def _mask(real_per_step: list[list[int]]) -> np.ndarray:
    """``[n, R * B]`` bool: in each step, replica r's first ``k[r]`` rows are real."""
    mask = np.zeros((len(real_per_step), R, B), bool)
    for i, ks in enumerate(real_per_step):
        for r, k in enumerate(ks):
            mask[i, r, :k] = True
    return mask.reshape(len(real_per_step), R * B)


MASKS = {
    "all real": [[3, 3, 3, 3], [3, 3, 3, 3]],
    "last step partly padding": [[3, 3, 3, 3], [3, 2, 0, 0]],
    "one row": [[1, 0, 0, 0]],
    "replicas padded alike": [[2, 2, 2, 2]],
    "a step of padding only": [[3, 3, 3, 3], [0, 0, 0, 0]],
}


def _per_row(mask: np.ndarray) -> np.ndarray:
    rng = np.random.RandomState(mask.size)
    rows = rng.rand(*mask.shape) * 2
    return np.where(mask, rows, PAD_LOSS)


@pytest.mark.parametrize("real", MASKS.values(), ids=list(MASKS))
def test_masked_loss_gives_the_sum_over_real_rows(real):
    mask = _mask(real)
    per_row = _per_row(mask).reshape(len(real), R, B)
    k = mask.reshape(len(real), R, B).sum(-1)
    sums = np.where(mask.reshape(len(real), R, B), per_row, 0.0).sum(-1)
    losses = np.where(k > 0, sums / np.maximum(k, 1), 0.0)  # the masked mean per replica
    assert not eval_loss.needs_pad_losses(mask, R, masked=True)
    got = eval_loss.real_loss_sum(losses, mask, R, pad_losses=None)
    np.testing.assert_allclose(got, np.where(mask, _per_row(mask), 0.0).sum(), rtol=1e-12)


@pytest.mark.parametrize("real", MASKS.values(), ids=list(MASKS))
def test_unmasked_loss_needs_the_padding_rows_loss(real):
    mask = _mask(real)
    per_row = _per_row(mask).reshape(len(real), R, B)
    losses = per_row.mean(-1) + CONSTANT  # plain mean over all rows, padding included
    pad_losses = np.full(R, PAD_LOSS + CONSTANT)  # a batch of padding rows only
    k = mask.reshape(len(real), R, B).sum(-1)
    partly = bool(np.any((k > 0) & (k < B)))
    assert eval_loss.needs_pad_losses(mask, R, masked=False) is partly
    got = eval_loss.real_loss_sum(losses, mask, R, pad_losses=pad_losses)
    # The constant counts once per real row, as in a per-row loss.
    want = np.where(mask, _per_row(mask) + CONSTANT, 0.0).sum()
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_losses_of_steps_beyond_the_mask_are_ignored():
    mask = _mask([[3, 3, 3, 3]])
    losses = np.array([[1.0] * R, [99.0] * R])  # a second, unused step
    assert eval_loss.real_loss_sum(losses, mask, R, pad_losses=None) == 12.0


class _Chunk(NamedTuple):
    features: dict
    labels: object
    mask: object


@pytest.mark.parametrize("with_labels", [True, False])
def test_all_padding_is_zeros_shaped_and_placed_like_the_chunk(with_labels):
    mesh = make_mesh()
    batch = NamedSharding(mesh, P(None, "data"))
    chunk = _Chunk(
        {"x": jax.device_put(np.ones((2, 16, 3), np.float32), batch)},
        jax.device_put(np.ones((2, 16), np.int32), batch) if with_labels else None,
        jax.device_put(np.ones((2, 16), np.float32), batch),
    )
    features, labels, mask = eval_loss.all_padding(chunk)
    assert features["x"].sharding == chunk.features["x"].sharding
    np.testing.assert_array_equal(np.asarray(features["x"]), np.zeros((2, 16, 3), np.float32))
    assert np.asarray(mask).dtype == np.float32 and not np.asarray(mask).any()
    if with_labels:
        assert labels.dtype == np.int32 and labels.sharding == batch
        assert not np.asarray(labels).any()
    else:
        assert labels is None
