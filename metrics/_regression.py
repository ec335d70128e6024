"""Regression metrics: mean squared, root mean squared and mean absolute error.

Each is a weighted average over every entry of `labels`/`predictions` (TF v1 semantics), so
merging batches is exact up to float rounding.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from metrics._aggregate import _Elementwise
from metrics._inputs import ArrayLike


def _errors(labels: np.ndarray, predictions: np.ndarray) -> np.ndarray:
    return predictions.astype(np.float64) - labels.astype(np.float64)


def _squared_errors(labels: np.ndarray, predictions: np.ndarray) -> np.ndarray:
    return np.square(_errors(labels, predictions))


def _absolute_errors(labels: np.ndarray, predictions: np.ndarray) -> np.ndarray:
    return np.abs(_errors(labels, predictions))


@dataclasses.dataclass(frozen=True, eq=False)
class MeanSquaredError(_Elementwise):
    """State of `metrics.mean_squared_error`."""

    _values = staticmethod(_squared_errors)


@dataclasses.dataclass(frozen=True, eq=False)
class RootMeanSquaredError(_Elementwise):
    """State of `metrics.root_mean_squared_error` (the square root is taken in `compute`)."""

    _values = staticmethod(_squared_errors)

    def compute(self) -> float:
        return math.sqrt(max(super().compute(), 0.0))


@dataclasses.dataclass(frozen=True, eq=False)
class MeanAbsoluteError(_Elementwise):
    """State of `metrics.mean_absolute_error`."""

    _values = staticmethod(_absolute_errors)


def mean_squared_error(
    labels: ArrayLike,
    predictions: ArrayLike,
    weights: ArrayLike | None = None,
    *,
    mask: ArrayLike | None = None,
) -> MeanSquaredError:
    """The weighted mean of `(predictions - labels) ** 2` over every entry.

    Args:
      labels: array of the same shape as `predictions` (a trailing axis of size 1 on either
        side is squeezed, as TF does).
      predictions: array of any shape.
      weights: optional scalar or array broadcastable to `labels` (per-row `[N]` weights are
        expanded over trailing dimensions); 0 excludes an entry.
      mask: optional keyword; entries where it is 0/False are excluded.

    Returns:
      A `MeanSquaredError`; `compute()` is 0.0 when the weights sum to 0.

    Raises:
      ValueError: if the shapes of `labels`, `predictions` or `weights` do not match.

    Example:

    >>> import metrics
    >>> metrics.mean_squared_error([0.0, 1.0], [1.0, 3.0]).compute()
    2.5
    """
    return MeanSquaredError.from_model_output(labels, predictions, weights, mask=mask)


def root_mean_squared_error(
    labels: ArrayLike,
    predictions: ArrayLike,
    weights: ArrayLike | None = None,
    *,
    mask: ArrayLike | None = None,
) -> RootMeanSquaredError:
    """The square root of `mean_squared_error`, taken after merging (never per batch).

    Args:
      labels: array of the same shape as `predictions`.
      predictions: array of any shape.
      weights: optional, as in `mean_squared_error`.
      mask: optional keyword; entries where it is 0/False are excluded.

    Returns:
      A `RootMeanSquaredError`.

    Example:

    >>> import metrics
    >>> metrics.root_mean_squared_error([0.0, 0.0], [3.0, 4.0], weights=[1, 0]).compute()
    3.0
    """
    return RootMeanSquaredError.from_model_output(labels, predictions, weights, mask=mask)


def mean_absolute_error(
    labels: ArrayLike,
    predictions: ArrayLike,
    weights: ArrayLike | None = None,
    *,
    mask: ArrayLike | None = None,
) -> MeanAbsoluteError:
    """The weighted mean of `|predictions - labels|` over every entry.

    Args:
      labels: array of the same shape as `predictions`.
      predictions: array of any shape.
      weights: optional, as in `mean_squared_error`.
      mask: optional keyword; entries where it is 0/False are excluded.

    Returns:
      A `MeanAbsoluteError`.

    Example:

    >>> import metrics
    >>> metrics.mean_absolute_error([[0.0], [1.0]], [[1.0], [3.0]]).compute()
    1.5
    """
    return MeanAbsoluteError.from_model_output(labels, predictions, weights, mask=mask)
