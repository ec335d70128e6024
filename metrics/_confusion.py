"""Binary metrics from thresholded confusion counts: TP/FP/TN/FN, precision, recall.

Labels are cast to bool (nonzero is positive) as in TF. A prediction is positive at a
threshold `t` when `prediction > t`; boolean predictions count as 0.0/1.0. With the default
`thresholds=None` the threshold is 0.5 (Keras' `thresholds=None` convention), which for 0/1 or
boolean predictions is the same as TF v1's cast to bool and for probabilities is the usual
decision rule. (TF v1's `tf.metrics.precision` casts *any* nonzero prediction to True; we do
not, so probabilities work as expected.) A list of thresholds gives one value per threshold,
like TF's `*_at_thresholds`.

The state is the weighted count of each confusion cell at every threshold, so merging batches
is exact (for integer weights). `metrics.auc` builds on the same counting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar, Protocol, TypeVar

import numpy as np

from metrics import _inputs
from metrics._inputs import ArrayLike
from metrics.base import Metric, static_field

Thresholds = float | Sequence[float] | None
_T = TypeVar("_T", bound="_Thresholded")
_T_co = TypeVar("_T_co", bound="_Thresholded", covariant=True)


def _threshold_array(thresholds: Thresholds) -> tuple[np.ndarray, bool]:
    """Returns (thresholds as a 1-D float64 array, whether results are scalars)."""
    if thresholds is None:
        return np.array([0.5]), True
    array = _inputs.to_array(thresholds, "thresholds").astype(np.float64)
    if array.ndim > 1 or array.size == 0 or not np.all(np.isfinite(array)):
        raise ValueError(
            "`thresholds` must be a float or a non-empty list of finite floats, "
            f"got {thresholds!r}."
        )
    return array.reshape(-1), array.ndim == 0


def counts_at_thresholds(
    labels: ArrayLike,
    predictions: ArrayLike,
    weights: ArrayLike | None,
    mask: ArrayLike | None,
    thresholds: np.ndarray,
    *,
    probabilities: bool = False,
) -> dict[str, np.ndarray]:
    """Weighted tp/fp/tn/fn at each threshold, via one sort of the thresholds (not N x K)."""
    labels_array, predictions_array = _inputs.labels_and_predictions(labels, predictions)
    w = _inputs.broadcast_weights(weights, labels_array.shape, mask=mask).reshape(-1)
    positive = (labels_array.reshape(-1) != 0) & (w != 0)
    negative = (labels_array.reshape(-1) == 0) & (w != 0)
    scores = predictions_array.reshape(-1).astype(np.float64)
    if probabilities:
        outside = (w != 0) & ~((scores >= 0) & (scores <= 1))
        if np.any(outside):
            raise ValueError(
                f"`predictions` must be probabilities in [0, 1], got {scores[outside][0]!r}."
            )
    order = np.argsort(thresholds, kind="stable")
    # bucket[i] = number of thresholds strictly below score i, i.e. where score i is positive.
    bucket = np.searchsorted(thresholds[order], scores, side="left")
    bucket[np.isnan(scores)] = 0  # NaN > t is False everywhere
    k = thresholds.size
    pos = np.bincount(bucket, weights=np.where(positive, w, 0.0), minlength=k + 1)
    neg = np.bincount(bucket, weights=np.where(negative, w, 0.0), minlength=k + 1)
    sorted_counts = {
        "tp": np.cumsum(pos[::-1])[::-1][1:],
        "fp": np.cumsum(neg[::-1])[::-1][1:],
        "fn": np.cumsum(pos)[:k],
        "tn": np.cumsum(neg)[:k],
    }
    result = {}
    for name, values in sorted_counts.items():
        unsorted = np.empty(k, np.float64)
        unsorted[order] = values
        result[name] = unsorted
    return result


def div_no_nan(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    safe = np.where(denominator != 0, denominator, 1.0)
    return np.where(denominator != 0, numerator / safe, 0.0)


@dataclasses.dataclass(frozen=True, eq=False)
class _Thresholded(Metric):
    """Confusion counts at each threshold; subclasses differ only in `compute`.

    Attributes:
      tp, fp, tn, fn: weighted counts, one per threshold.
      thresholds: the thresholds, in the order given.
      single_threshold: whether `thresholds` was `None` or a float (a float result) rather
        than a list (an array result).
    """

    tp: np.ndarray
    fp: np.ndarray
    tn: np.ndarray
    fn: np.ndarray
    thresholds: np.ndarray = static_field()
    single_threshold: bool = static_field(default=True)

    @classmethod
    def empty(cls: type[_T], *, thresholds: Thresholds = None) -> _T:
        array, single = _threshold_array(thresholds)
        zeros = np.zeros(array.size)
        return cls(zeros, zeros, zeros, zeros, array, single)

    @classmethod
    def from_model_output(
        cls: type[_T],
        labels: ArrayLike,
        predictions: ArrayLike,
        weights: ArrayLike | None = None,
        *,
        thresholds: Thresholds = None,
        mask: ArrayLike | None = None,
    ) -> _T:
        """Same as the factory of the same name (e.g. `metrics.precision`)."""
        array, single = _threshold_array(thresholds)
        counts = counts_at_thresholds(labels, predictions, weights, mask, array)
        return cls(thresholds=array, single_threshold=single, **counts)

    def _value(self) -> np.ndarray:
        raise NotImplementedError

    def compute(self) -> float | np.ndarray:
        value = self._value()
        return float(value[0]) if self.single_threshold else value


class _Cell(_Thresholded):
    """The counts of one confusion cell, named by `_cell`."""

    _cell: ClassVar[str]

    def _value(self) -> np.ndarray:
        value: np.ndarray = getattr(self, self._cell)
        return value


class TruePositives(_Cell):
    """State of `metrics.true_positives`."""

    _cell = "tp"


class FalsePositives(_Cell):
    """State of `metrics.false_positives`."""

    _cell = "fp"


class TrueNegatives(_Cell):
    """State of `metrics.true_negatives`."""

    _cell = "tn"


class FalseNegatives(_Cell):
    """State of `metrics.false_negatives`."""

    _cell = "fn"


class Precision(_Thresholded):
    """State of `metrics.precision`: `tp / (tp + fp)`, 0 when nothing is predicted positive."""

    def _value(self) -> np.ndarray:
        return div_no_nan(self.tp, self.tp + self.fp)


class Recall(_Thresholded):
    """State of `metrics.recall`: `tp / (tp + fn)`, 0 when there are no positive labels."""

    def _value(self) -> np.ndarray:
        return div_no_nan(self.tp, self.tp + self.fn)


class _Factory(Protocol[_T_co]):
    """The signature of every factory below (`metrics.precision` and the rest)."""

    def __call__(
        self,
        labels: ArrayLike,
        predictions: ArrayLike,
        weights: ArrayLike | None = None,
        *,
        thresholds: Thresholds = None,
        mask: ArrayLike | None = None,
    ) -> _T_co: ...


_FACTORY_DOC = """{summary}

    Args:
      labels: array of the same shape as `predictions`, cast to bool (nonzero is positive).
      predictions: scores, probabilities or booleans; positive where `> threshold`.
      weights: optional scalar or array broadcastable to `labels` (per-row `[N]` weights are
        expanded over trailing dimensions); 0 excludes an entry.
      thresholds: keyword; `None` (0.5) or a float gives a float result, a list of floats
        gives an array with one value per threshold.
      mask: optional keyword; entries where it is 0/False are excluded.

    Returns:
      A `{metric}` metric.

    Raises:
      ValueError: if the shapes of `labels`, `predictions` or `weights` do not match.

    Example:

    >>> import metrics
    >>> {example}
    {result}
    """


def _factory(cls: type[_T], name: str, summary: str, example: str, result: str) -> _Factory[_T]:
    """The public function `name`, returning `cls.from_model_output` of its arguments."""

    def factory(
        labels: ArrayLike,
        predictions: ArrayLike,
        weights: ArrayLike | None = None,
        *,
        thresholds: Thresholds = None,
        mask: ArrayLike | None = None,
    ) -> _T:
        return cls.from_model_output(labels, predictions, weights, thresholds=thresholds, mask=mask)

    factory.__name__ = factory.__qualname__ = name
    factory.__annotations__["return"] = cls.__name__
    factory.__doc__ = _FACTORY_DOC.format(
        summary=summary, metric=cls.__name__, example=example, result=result
    )
    return factory


true_positives = _factory(
    TruePositives,
    "true_positives",
    "The weighted number of positive labels predicted positive.",
    "metrics.true_positives([1, 1, 0], [0.9, 0.2, 0.7]).compute()",
    "1.0",
)
false_positives = _factory(
    FalsePositives,
    "false_positives",
    "The weighted number of negative labels predicted positive.",
    "metrics.false_positives([1, 1, 0], [0.9, 0.2, 0.7]).compute()",
    "1.0",
)
true_negatives = _factory(
    TrueNegatives,
    "true_negatives",
    "The weighted number of negative labels predicted negative.",
    "metrics.true_negatives([1, 0, 0], [0.9, 0.2, 0.7], thresholds=[0.1, 0.5]).compute()",
    "array([0., 1.])",
)
false_negatives = _factory(
    FalseNegatives,
    "false_negatives",
    "The weighted number of positive labels predicted negative.",
    "metrics.false_negatives([True, True], [True, False]).compute()",
    "1.0",
)
precision = _factory(
    Precision,
    "precision",
    "Precision, `tp / (tp + fp)` (0.0 when nothing is predicted positive).",
    "metrics.precision([1, 1, 0, 0], [0.9, 0.8, 0.7, 0.1]).compute()",
    "0.6666666666666666",
)
recall = _factory(
    Recall,
    "recall",
    "Recall, `tp / (tp + fn)` (0.0 when there are no positive labels).",
    "metrics.recall([1, 1, 0, 0], [0.9, 0.2, 0.7, 0.1], weights=[1, 3, 1, 1]).compute()",
    "0.25",
)
