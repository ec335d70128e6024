"""Generic metrics: weighted `Mean` and `Sum`, `as_metric`, and the host-collecting metric.

`Mean` is the state behind `metrics.mean` and the base of every averaged metric (accuracy,
the regression errors); `as_metric` wraps a plain number returned by a user's `metric_fn`;
`Collecting` keeps every row and is the explicit, memory-hungry escape hatch for statistics
that are not sums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from metrics import _inputs
from metrics._inputs import ArrayLike
from metrics.base import Metric, static_field

_A = TypeVar("_A", bound="_Average")
_E = TypeVar("_E", bound="_Elementwise")


@dataclasses.dataclass(frozen=True, eq=False)
class _Average(Metric):
    """Weighted average state: `total = sum(w * v)`, `count = sum(w)`; 0 when `count` is 0."""

    total: float = 0.0
    count: float = 0.0

    @classmethod
    def empty(cls: type[_A]) -> _A:
        return cls(0.0, 0.0)

    @classmethod
    def _of(
        cls: type[_A],
        values: np.ndarray,
        weights: ArrayLike | None,
        mask: ArrayLike | None,
        target: str,
    ) -> _A:
        if weights is None and mask is None:  # every entry counts once: no weights array
            return cls(float(np.sum(values, dtype=np.float64)), float(values.size))
        w = _inputs.broadcast_weights(weights, values.shape, mask=mask, target=target)
        return cls(_inputs.weighted_sum(values.astype(np.float64), w), float(np.sum(w)))

    def compute(self) -> float:
        # TF's div_no_nan: the mean of nothing is 0.
        return float(self.total / self.count) if self.count != 0 else 0.0


@dataclasses.dataclass(frozen=True, eq=False)
class _Elementwise(_Average):
    """Weighted average of `_values(labels, predictions)`, one value per matched entry."""

    @classmethod
    def from_model_output(
        cls: type[_E],
        labels: ArrayLike,
        predictions: ArrayLike,
        weights: ArrayLike | None = None,
        *,
        mask: ArrayLike | None = None,
    ) -> _E:
        """Same as the factory of the same name (e.g. `metrics.accuracy`)."""
        labels_array, predictions_array = _inputs.labels_and_predictions(labels, predictions)
        return cls._of(cls._values(labels_array, predictions_array), weights, mask, "labels")

    @staticmethod
    def _values(labels: np.ndarray, predictions: np.ndarray) -> np.ndarray:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, eq=False)
class Mean(_Average):
    """The weighted mean of values; what `metrics.mean` and `metrics.as_metric` return."""

    @classmethod
    def from_model_output(
        cls, values: ArrayLike, weights: ArrayLike | None = None, *, mask: ArrayLike | None = None
    ) -> Mean:
        """Same as `metrics.mean`."""
        return cls._of(_inputs.to_array(values, "values"), weights, mask, "values")


def mean(
    values: ArrayLike, weights: ArrayLike | None = None, *, mask: ArrayLike | None = None
) -> Mean:
    """The weighted mean of `values` (`tf.compat.v1.metrics.mean`).

    Args:
      values: array of any shape; every entry counts.
      weights: optional scalar or array broadcastable to `values` (per-row weights of shape
        `[N]` are expanded over trailing dimensions); 0 excludes an entry.
      mask: optional keyword; entries where it is 0/False are excluded (same as weight 0).

    Returns:
      A `Mean`; `compute()` is `sum(weights * values) / sum(weights)`, or 0.0 when the
      weights sum to 0 (TF's convention).

    Example:

    >>> import metrics
    >>> m = metrics.mean([1.0, 2.0, 3.0], weights=[1, 1, 0])
    >>> m.merge(metrics.mean([4.5])).compute()
    2.5
    """
    return Mean.from_model_output(values, weights, mask=mask)


@dataclasses.dataclass(frozen=True, eq=False)
class Sum(Metric):
    """The weighted sum of values, e.g. a count of examples or of errors.

    Example:

    >>> import metrics
    >>> metrics.Sum.from_model_output([1, 2, 3], weights=[1, 0, 1]).compute()
    4.0
    """

    total: float = 0.0

    @classmethod
    def empty(cls) -> Sum:
        return cls(0.0)

    @classmethod
    def from_model_output(
        cls, values: ArrayLike, weights: ArrayLike | None = None, *, mask: ArrayLike | None = None
    ) -> Sum:
        """Returns `sum(weights * values)` over the batch (weights as in `metrics.mean`)."""
        values = _inputs.to_array(values, "values")
        w = _inputs.broadcast_weights(weights, values.shape, mask=mask, target="values")
        return cls(_inputs.weighted_sum(values.astype(np.float64), w))

    def compute(self) -> float:
        return float(self.total)


def as_metric(value: Any, num_examples: int | float) -> Metric:
    """Wraps a plain number returned by a `metric_fn` as a mean weighted by example count.

    The estimator calls this for every non-`Metric` value a `metric_fn` returns, so a batch
    statistic such as `np.mean(errors)` becomes the example-weighted mean over all batches.

    Args:
      value: a python/numpy scalar (or size-1 array), or a `Metric` (returned unchanged).
      num_examples: the number of (real, unpadded) examples the value was computed on.

    Returns:
      A `Mean` with `total = value * num_examples` and `count = num_examples`.

    Raises:
      TypeError: if `value` is not numeric.
      ValueError: if `value` has more than one element or `num_examples` is negative.

    Example:

    >>> import metrics
    >>> metrics.as_metric(0.5, 2).merge(metrics.as_metric(0.8, 8)).compute()
    0.74
    """
    if isinstance(value, Metric):
        return value
    array = _inputs.to_array(value, "value")
    if array.size != 1:
        raise ValueError(
            f"`value` must be a scalar or a metrics.Metric, got an array of shape "
            f"{array.shape}; return e.g. metrics.mean(values) for per-example values."
        )
    count = float(num_examples)
    if not count >= 0:
        raise ValueError(f"`num_examples` must be >= 0, got {num_examples!r}.")
    total = float(array.reshape(())) * count if count else 0.0
    return Mean(total, count)


@dataclasses.dataclass(frozen=True, eq=False)
class Collecting(Metric):
    """Host-collecting metric: keeps every row and calls `fn` on the concatenation at the end.

    Use it for statistics that are not sums of per-batch pieces (an exact ROC AUC, a median).
    Memory grows with the evaluation set, and `fn` sees all rows at once, so prefer the
    streaming metrics when they fit. Build it with `metrics.collecting`.

    Attributes:
      fn: called as `fn(*arrays)` by `compute`; metrics merge if their `fn` has the same code,
        so a lambda written inside `metric_fn` is fine.
      chunks: one tuple of arrays per batch, concatenated lazily by `compute`.
    """

    fn: Callable[..., Any] = static_field()
    chunks: tuple[tuple[np.ndarray, ...], ...] = ()

    @classmethod
    def empty(cls, fn: Callable[..., Any]) -> Collecting:
        return cls(fn, ())

    @classmethod
    def from_model_output(
        cls, fn: Callable[..., Any], *arrays: ArrayLike, mask: ArrayLike | None = None
    ) -> Collecting:
        """Same as `metrics.collecting`."""
        if not callable(fn):
            raise TypeError(f"`fn` must be callable, got {type(fn).__name__}.")
        if not arrays:
            raise ValueError("`arrays` must hold at least one array to collect.")
        converted = tuple(np.asarray(a) for a in arrays)
        for i, a in enumerate(converted):
            if a.ndim == 0 or a.shape[0] != converted[0].shape[0]:
                raise ValueError(
                    f"`arrays[{i}]` has shape {a.shape}; every array needs the same number of "
                    f"rows along axis 0 ({converted[0].shape[0] if converted[0].ndim else 'n/a'})."
                )
        if mask is not None:
            keep = _inputs.to_array(mask, "mask")
            if keep.shape != converted[0].shape[:1]:
                raise ValueError(
                    f"`mask` shape {keep.shape} must be one entry per row, "
                    f"{converted[0].shape[:1]}."
                )
            converted = tuple(a[keep != 0] for a in converted)
        return cls(fn, (converted,))

    def _merge(self, other: Collecting) -> Collecting:
        if self.chunks and other.chunks:
            mine, theirs = self.chunks[0], other.chunks[0]
            if len(mine) != len(theirs) or any(
                a.shape[1:] != b.shape[1:] for a, b in zip(mine, theirs, strict=True)
            ):
                raise ValueError(
                    "Cannot merge Collecting metrics whose arrays differ in number or trailing "
                    f"shape: {[a.shape for a in mine]} vs {[b.shape for b in theirs]}."
                )
        return Collecting(self.fn, self.chunks + other.chunks)

    def compute(self) -> Any:
        """Returns `fn(*arrays)` on every collected row, in merge order.

        Raises:
          ValueError: if nothing was collected (only `empty` states were merged).
        """
        if not self.chunks:
            raise ValueError("Collecting metric has no data: nothing was collected.")
        arrays = (np.concatenate(parts, axis=0) for parts in zip(*self.chunks, strict=True))
        return self.fn(*arrays)


def collecting(
    fn: Callable[..., Any], *arrays: ArrayLike, mask: ArrayLike | None = None
) -> Collecting:
    """A host-collecting metric: `fn(*all_rows)` computed once, after the last batch.

    Args:
      fn: the function computing the value from the concatenated arrays.
      *arrays: the batch's arrays, all with the same number of rows (axis 0).
      mask: optional keyword, one entry per row; rows where it is 0/False are dropped.

    Returns:
      A `Collecting` metric.

    Example:

    >>> import numpy as np, metrics
    >>> median = lambda values: float(np.median(values))
    >>> m = metrics.collecting(median, np.array([1.0, 9.0]))
    >>> m.merge(metrics.collecting(median, np.array([2.0]))).compute()
    2.0
    """
    return Collecting.from_model_output(fn, *arrays, mask=mask)
