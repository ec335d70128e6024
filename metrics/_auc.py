"""`auc`: area under the ROC or precision-recall curve, thresholded like TF v1.

The curve is approximated by confusion counts at `num_thresholds` fixed thresholds
(`-1e-7, 1/(n-1), ..., (n-2)/(n-1), 1+1e-7`), so the state is a few count vectors, merging
is exact, and the value equals TF's `tf.compat.v1.metrics.auc` on the same data. It differs
from an exact (sorted) AUC by the discretisation, about `1/num_thresholds` at worst; use
`metrics.collecting` with `sklearn.metrics.roc_auc_score` when the exact value matters.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import numpy as np

from metrics import _confusion
from metrics._inputs import ArrayLike
from metrics.base import Metric, static_field

_KEPSILON = 1e-7  # TF: endpoint thresholds just outside [0, 1].
_EPSILON = 1e-6  # TF: added to numerators and denominators of the curve's rates.
CURVES = ("ROC", "PR")
SUMMATION_METHODS = ("trapezoidal", "careful_interpolation", "minoring", "majoring")


def _auc_thresholds(num_thresholds: int, thresholds: Sequence[float] | None) -> np.ndarray:
    if thresholds is not None:
        inner = np.sort(np.asarray(thresholds, np.float64).reshape(-1))
    else:
        try:
            n = operator.index(num_thresholds)
        except TypeError as e:
            raise TypeError(f"`num_thresholds` must be an int, got {num_thresholds!r}.") from e
        if n < 2:
            raise ValueError(f"`num_thresholds` must be > 1, got {num_thresholds!r}.")
        inner = np.array([(i + 1) * 1.0 / (n - 1) for i in range(n - 2)])
    return np.concatenate([[0.0 - _KEPSILON], inner, [1.0 + _KEPSILON]])


def _interpolate_pr_auc(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> float:
    """TF's 'careful_interpolation' PR-AUC (Davis & Goadrich 2006, closed form)."""
    div = _confusion.div_no_nan
    dtp = tp[:-1] - tp[1:]
    p = tp + fp
    slope = div(dtp, np.maximum(p[:-1] - p[1:], 0))
    intercept = tp[1:] - slope * p[1:]
    both_positive = (p[:-1] > 0) & (p[1:] > 0)
    ratio = np.where(both_positive, div(p[:-1], np.maximum(p[1:], 0)), 1.0)
    ratio = np.where(ratio > 0, ratio, 1.0)  # only reached where both_positive is False
    increments = div(slope * (dtp + intercept * np.log(ratio)), np.maximum(tp[1:] + fn[1:], 0))
    return float(np.sum(increments))


@dataclasses.dataclass(frozen=True, eq=False)
class AUC(Metric):
    """State of `metrics.auc`: confusion counts at the curve's thresholds.

    Attributes:
      tp, fp, tn, fn: weighted counts at each threshold (ascending).
      thresholds: the thresholds, including the two endpoints.
      curve: 'ROC' or 'PR'.
      summation_method: how the area is summed (see `metrics.auc`).
    """

    tp: np.ndarray
    fp: np.ndarray
    tn: np.ndarray
    fn: np.ndarray
    thresholds: np.ndarray = static_field()
    curve: str = static_field(default="ROC")
    summation_method: str = static_field(default="trapezoidal")

    @classmethod
    def empty(
        cls,
        num_thresholds: int = 200,
        *,
        curve: str = "ROC",
        summation_method: str = "trapezoidal",
        thresholds: Sequence[float] | None = None,
    ) -> AUC:
        _check_options(curve, summation_method)
        array = _auc_thresholds(num_thresholds, thresholds)
        zeros = np.zeros(array.size)
        return cls(zeros, zeros, zeros, zeros, array, curve, summation_method)

    @classmethod
    def from_model_output(
        cls,
        labels: ArrayLike,
        predictions: ArrayLike,
        weights: ArrayLike | None = None,
        num_thresholds: int = 200,
        *,
        curve: str = "ROC",
        summation_method: str = "trapezoidal",
        thresholds: Sequence[float] | None = None,
        mask: ArrayLike | None = None,
    ) -> AUC:
        """Same as `metrics.auc`."""
        _check_options(curve, summation_method)
        array = _auc_thresholds(num_thresholds, thresholds)
        counts = _confusion.counts_at_thresholds(
            labels, predictions, weights, mask, array, probabilities=True
        )
        return cls(thresholds=array, curve=curve, summation_method=summation_method, **counts)

    def compute(self) -> float:
        tp, fp, tn, fn = self.tp, self.fp, self.tn, self.fn
        if self.curve == "PR" and self.summation_method == "careful_interpolation":
            return _interpolate_pr_auc(tp, fp, fn)
        recall = (tp + _EPSILON) / (tp + fn + _EPSILON)
        if self.curve == "ROC":
            x, y = fp / (fp + tn + _EPSILON), recall
        else:
            x, y = recall, (tp + _EPSILON) / (tp + fp + _EPSILON)
        if self.summation_method == "minoring":
            heights = np.minimum(y[:-1], y[1:])
        elif self.summation_method == "majoring":
            heights = np.maximum(y[:-1], y[1:])
        else:  # trapezoidal, or careful_interpolation on ROC (as in TF)
            heights = (y[:-1] + y[1:]) / 2.0
        return float(np.sum((x[:-1] - x[1:]) * heights))


def _check_options(curve: str, summation_method: str) -> None:
    if curve not in CURVES:
        raise ValueError(f"`curve` must be one of {CURVES}, got {curve!r}.")
    if summation_method not in SUMMATION_METHODS:
        raise ValueError(
            f"`summation_method` must be one of {SUMMATION_METHODS}, got {summation_method!r}."
        )


def auc(
    labels: ArrayLike,
    predictions: ArrayLike,
    weights: ArrayLike | None = None,
    num_thresholds: int = 200,
    *,
    curve: str = "ROC",
    summation_method: str = "trapezoidal",
    thresholds: Sequence[float] | None = None,
    mask: ArrayLike | None = None,
) -> AUC:
    """Area under the ROC or PR curve, computed like `tf.compat.v1.metrics.auc`.

    Args:
      labels: array of the same shape as `predictions`, cast to bool (nonzero is positive).
      predictions: probabilities in `[0, 1]` (entries of nonzero weight are checked).
      weights: optional scalar or array broadcastable to `labels` (per-row `[N]` weights are
        expanded over trailing dimensions); 0 excludes an entry.
      num_thresholds: number of thresholds discretising the curve (> 1).
      curve: keyword, 'ROC' (default) or 'PR'.
      summation_method: keyword; 'trapezoidal' (default), 'careful_interpolation' (the
        better choice for 'PR'; on 'ROC' it is trapezoidal, as in TF), 'minoring' (lower
        Riemann sum) or 'majoring' (upper Riemann sum).
      thresholds: keyword, optional explicit thresholds in `[0, 1]` replacing
        `num_thresholds`; the endpoints `-1e-7` and `1 + 1e-7` are added.
      mask: optional keyword; entries where it is 0/False are excluded.

    Returns:
      An `AUC` metric. With no examples, `compute()` is 0.0.

    Raises:
      ValueError: on mismatched shapes, predictions outside `[0, 1]`, or an unknown `curve`
        or `summation_method`.

    Example:

    >>> import metrics
    >>> round(metrics.auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]).compute(), 3)
    0.75
    """
    return AUC.from_model_output(
        labels,
        predictions,
        weights,
        num_thresholds,
        curve=curve,
        summation_method=summation_method,
        thresholds=thresholds,
        mask=mask,
    )
