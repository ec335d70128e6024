"""Data sets that ship with installed packages (nothing is downloaded) and their input_fns.

Every factory returns ``{"train": input_fn, "eval": input_fn, "predict": input_fn}``. Training
input repeats forever in a fixed shuffled order per epoch (seeded, so a resumed run sees the same
batches); eval and predict input goes through the data once, the last batch partial.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def _digits_arrays(seed: int = 0, eval_fraction: float = 0.2):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.RandomState(seed).permutation(len(x))
    n_eval = int(round(len(x) * eval_fraction))
    ev, tr = order[:n_eval], order[n_eval:]
    return (x[tr], y[tr]), (x[ev], y[ev])


def repeat_batches(x, y, batch_size: int, *, seed: int = 0):
    """Endless (features, labels) batches, reshuffled each epoch with a seeded order."""
    epoch = 0
    while True:
        order = np.random.RandomState(seed + epoch).permutation(len(x))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[i : i + batch_size]
            yield x[idx], y[idx]
        epoch += 1


def once_batches(x, y, batch_size: int, *, with_labels: bool = True):
    """One pass in order; the last batch is partial (the estimator pads and masks it)."""
    for i in range(0, len(x), batch_size):
        rows = slice(i, i + batch_size)
        yield (x[rows], y[rows]) if with_labels else x[rows]


def shard_batches(make_batches: Callable[[int], Any], params: dict, input_context=None):
    """This input pipeline's rows of each batch of ``make_batches(batch_size * pipelines)``.

    With several pipelines (one per process of a many-host job) pipeline ``i`` takes rows
    ``[i * b, (i + 1) * b)`` of every combined batch, so the processes together see exactly the
    batches one process would, in the same order. It ends when its share of a batch is empty.
    """
    n, i = (
        (1, 0)
        if input_context is None
        else (input_context.num_input_pipelines, input_context.input_pipeline_id)
    )
    b = params["batch_size"]
    for batch in make_batches(b * n):
        if n == 1:
            yield batch
            continue
        part = (
            tuple(a[i * b : (i + 1) * b] for a in batch)
            if isinstance(batch, tuple)
            else (batch[i * b : (i + 1) * b])
        )
        if len(part[0] if isinstance(part, tuple) else part) == 0:
            return
        yield part


def input_fns(
    train: tuple, evaluation: tuple, *, image_shape: tuple | None = None, seed: int = 0
) -> dict[str, Callable]:
    """Standard train/eval/predict input_fns over numpy arrays (sharded by input_context)."""

    def shape(x):
        return x if image_shape is None else x.reshape(len(x), *image_shape)

    (xt, yt), (xe, ye) = (shape(train[0]), train[1]), (shape(evaluation[0]), evaluation[1])
    return {
        "train": lambda params, input_context=None: shard_batches(
            lambda b: repeat_batches(xt, yt, b, seed=seed), params, input_context
        ),
        "eval": lambda params, input_context=None: shard_batches(
            lambda b: once_batches(xe, ye, b), params, input_context
        ),
        "predict": lambda params, input_context=None: shard_batches(
            lambda b: once_batches(xe, ye, b, with_labels=False), params, input_context
        ),
    }


def digits(config=None) -> dict[str, Callable]:
    """scikit-learn's bundled 8x8 digits: 1437 train / 360 eval examples, 10 classes.

    ``config.image`` (when set) shapes features as 8x8x1 images for convolutional models.
    """
    image = bool(config is not None and config.get("image", False))
    seed = 0 if config is None else int(config.get("seed", 0))
    return input_fns(*_digits_arrays(), image_shape=(8, 8, 1) if image else None, seed=seed)


def synthetic_images(config) -> dict[str, Callable]:
    """Random images and labels sized like CIFAR-10 or ImageNet, for throughput runs."""
    h, w, c = config.image_size
    n_train, n_eval = config.get("num_train_examples", 1024), config.get("num_eval_examples", 256)
    rng = np.random.RandomState(0)
    x = rng.rand(n_train + n_eval, h, w, c).astype(np.float32)
    y = rng.randint(0, config.num_classes, n_train + n_eval).astype(np.int32)
    return input_fns((x[:n_train], y[:n_train]), (x[n_train:], y[n_train:]))


DATASETS: dict[str, Callable] = {"digits": digits, "synthetic_images": synthetic_images}
