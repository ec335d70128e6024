"""Input checks shared by the metric factories: arrays, shapes, weights, masks, class ids.

Every factory goes through these helpers, so a bad input fails the same way everywhere and the
error names the argument. Weights follow TF v1: `None` means 1, a scalar applies to all
entries, otherwise the weights broadcast to the target's shape, where a weight array with fewer
dimensions is expanded with trailing 1s (so per-row weights of shape `[N]` work for `[N, D]`
values). A weight of 0 excludes an entry exactly, even if its value is NaN (padding).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

ArrayLike = Any  # anything `np.asarray` accepts: arrays, lists, python scalars


def to_array(value: ArrayLike, name: str) -> np.ndarray:
    """Returns `value` as a numeric or boolean numpy array, or raises naming `name`."""
    if value is None:
        raise TypeError(f"`{name}` must be a numpy array, got None.")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"`{name}` could not be converted to a numpy array: {e}") from e
    if array.dtype.kind not in "biuf":  # bool, int, uint, float (one lookup: once per batch)
        raise TypeError(f"`{name}` must be real numbers or booleans, got dtype {array.dtype}.")
    return array


def match_shapes(
    labels: np.ndarray,
    predictions: np.ndarray,
    *,
    names: Sequence[str] = ("labels", "predictions"),
) -> tuple[np.ndarray, np.ndarray]:
    """Squeezes a trailing size-1 axis off one side (as TF does), then requires equal shapes."""
    if labels.ndim == predictions.ndim + 1 and labels.shape[-1] == 1:
        labels = labels[..., 0]
    elif predictions.ndim == labels.ndim + 1 and predictions.shape[-1] == 1:
        predictions = predictions[..., 0]
    if labels.shape != predictions.shape:
        raise ValueError(
            f"`{names[0]}` shape {labels.shape} does not match `{names[1]}` shape "
            f"{predictions.shape}."
        )
    return labels, predictions


def labels_and_predictions(
    labels: ArrayLike, predictions: ArrayLike
) -> tuple[np.ndarray, np.ndarray]:
    """Returns `labels` and `predictions` as arrays of one shape (`to_array`, `match_shapes`)."""
    return match_shapes(to_array(labels, "labels"), to_array(predictions, "predictions"))


def _broadcast(array: np.ndarray, shape: tuple[int, ...], name: str, target: str) -> np.ndarray:
    if array.ndim == 0:
        return np.broadcast_to(array, shape)
    original = array.shape
    while array.ndim > len(shape) and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim < len(shape):
        array = array.reshape(array.shape + (1,) * (len(shape) - array.ndim))
    if array.ndim != len(shape) or any(
        a not in (1, s) for a, s in zip(array.shape, shape, strict=True)
    ):
        raise ValueError(
            f"`{name}` shape {original} cannot be broadcast to `{target}` shape {shape}: "
            "pass a scalar, one value per row, or a shape whose every dimension is 1 or "
            "matches."
        )
    return np.broadcast_to(array, shape)


def broadcast_weights(
    weights: ArrayLike | None,
    shape: tuple[int, ...],
    *,
    mask: ArrayLike | None = None,
    target: str = "labels",
) -> np.ndarray:
    """Returns float64 weights of `shape`, zeroed where `mask` is False or 0.

    Args:
      weights: `None` (all ones), a scalar, or an array broadcastable to `shape`.
      shape: the shape of the entries being weighted.
      mask: optional, broadcast like `weights`; entries where it is 0/False get weight 0.
      target: the argument whose shape `shape` is, for error messages.

    Returns:
      A float64 array of exactly `shape`.
    """
    if weights is None:
        result = np.ones(shape, np.float64)
    else:
        result = _broadcast(
            to_array(weights, "weights").astype(np.float64), shape, "weights", target
        )
    if mask is not None:
        keep = _broadcast(to_array(mask, "mask") != 0, shape, "mask", target)
        result = np.where(keep, result, 0.0)
    return result


def weighted_sum(values: np.ndarray, weights: np.ndarray) -> float:
    """Sum of `values * weights`, ignoring entries of weight 0 even when they are NaN/inf."""
    values = np.where(weights != 0, values, 0.0)
    return float(np.sum(values * weights, dtype=np.float64))


def positive_int(value: int, name: str) -> int:
    """Returns `value` as a python int >= 1 (not a bool), or raises naming `name`."""
    try:
        result = operator.index(value)
    except TypeError as e:
        raise TypeError(f"`{name}` must be an int, got {value!r}.") from e
    if isinstance(value, bool) or result < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    return result


def class_ids(
    values: np.ndarray, weights: np.ndarray, name: str, num_classes: int | None = None
) -> np.ndarray:
    """Returns integer class ids as int64; entries of weight 0 are not checked (set to 0).

    Args:
      values: integer-valued array (ints, bools, or floats holding whole numbers).
      weights: same shape as `values`.
      name: the argument name, for error messages.
      num_classes: if given, weighted ids must lie in `[0, num_classes)`.

    Returns:
      An int64 array of `values`' shape.
    """
    live = weights != 0
    if np.issubdtype(values.dtype, np.floating):
        bad = live & ~(np.isfinite(values) & (values == np.round(values)))
        if np.any(bad):
            raise ValueError(f"`{name}` must hold integer class ids, got {values[bad].flat[0]!r}.")
    ids = np.where(live, values, 0).astype(np.int64)
    if num_classes is not None:
        bad = live & ((ids < 0) | (ids >= num_classes))
        if np.any(bad):
            raise ValueError(
                f"`{name}` must hold class ids in [0, num_classes={num_classes}), got "
                f"{ids[bad].flat[0]}."
            )
    return ids
