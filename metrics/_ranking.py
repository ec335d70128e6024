"""`recall_at_k`: how often the true class is among the `k` highest-scored classes.

Ranks follow `tf.math.top_k`: higher scores first, ties broken by the lower class index. The
rank of the true class is counted directly (`O(N * C)`, no sort), so ties cannot make the
result depend on a sort's stability.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from metrics import _inputs
from metrics._inputs import ArrayLike
from metrics.base import Metric, static_field


def _in_top_k(scores: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """Whether each row's label is among its top `k` scores; out-of-range labels never are."""
    num_classes = scores.shape[1]
    valid = (labels >= 0) & (labels < num_classes)
    safe = np.where(valid, labels, 0)
    label_scores = np.take_along_axis(scores, safe[:, None], axis=1)
    lower_index = np.arange(num_classes)[None, :] < safe[:, None]
    ahead = (scores > label_scores) | ((scores == label_scores) & lower_index)
    hit: np.ndarray = valid & (np.count_nonzero(ahead, axis=1) < k)
    return hit


@dataclasses.dataclass(frozen=True, eq=False)
class RecallAtK(Metric):
    """State of `metrics.recall_at_k`.

    Attributes:
      tp: weight of relevant rows whose label is in the top `k`.
      fn: weight of relevant rows whose label is not.
      k: the number of top classes considered.
      class_id: if set, only rows labelled `class_id` are relevant.
    """

    tp: float
    fn: float
    k: int = static_field()
    class_id: int | None = static_field(default=None)

    @classmethod
    def empty(cls, k: int, class_id: int | None = None) -> RecallAtK:
        return cls(0.0, 0.0, _inputs.positive_int(k, "k"), class_id)

    @classmethod
    def from_model_output(
        cls,
        labels: ArrayLike,
        predictions: ArrayLike,
        k: int,
        class_id: int | None = None,
        weights: ArrayLike | None = None,
        *,
        mask: ArrayLike | None = None,
    ) -> RecallAtK:
        """Same as `metrics.recall_at_k`."""
        k = _inputs.positive_int(k, "k")
        scores = _inputs.to_array(predictions, "predictions")
        labels_array = _inputs.to_array(labels, "labels")
        if scores.ndim < 1:
            raise ValueError("`predictions` must have shape [N, num_classes], got a scalar.")
        if labels_array.ndim == scores.ndim and labels_array.shape[-1] == 1:
            labels_array = labels_array[..., 0]
        if labels_array.shape != scores.shape[:-1]:
            raise ValueError(
                f"`labels` shape {labels_array.shape} must be `predictions` shape "
                f"{scores.shape} without its last (class) axis."
            )
        num_classes = scores.shape[-1]
        if k > num_classes:
            raise ValueError(
                f"`k`={k} exceeds the number of classes in `predictions`, {num_classes}."
            )
        if class_id is not None:
            class_id = operator.index(class_id)
            if not 0 <= class_id < num_classes:
                raise ValueError(f"`class_id` must be in [0, {num_classes}), got {class_id}.")
        w = _inputs.broadcast_weights(weights, labels_array.shape, mask=mask).reshape(-1)
        ids = _inputs.class_ids(labels_array.reshape(-1), w, "labels")
        hit = _in_top_k(scores.reshape(-1, num_classes).astype(np.float64), ids, k)
        relevant = w != 0 if class_id is None else (w != 0) & (ids == class_id)
        tp = float(np.sum(np.where(relevant & hit, w, 0.0)))
        fn = float(np.sum(np.where(relevant & ~hit, w, 0.0)))
        return cls(tp, fn, k, class_id)

    def compute(self) -> float:
        total = self.tp + self.fn
        return float(self.tp / total) if total != 0 else 0.0


def recall_at_k(
    labels: ArrayLike,
    predictions: ArrayLike,
    k: int,
    class_id: int | None = None,
    weights: ArrayLike | None = None,
    *,
    mask: ArrayLike | None = None,
) -> RecallAtK:
    """The fraction of rows whose true class is among the `k` top-scored classes.

    With one label per row this is top-k accuracy. Follows `tf.compat.v1.metrics.recall_at_k`
    with dense single labels: labels outside `[0, num_classes)` count as misses (false
    negatives). Unlike TF (which returns NaN), the value is 0.0 when no row is relevant.

    Args:
      labels: integer class ids, shape `[N]` (or `[N, 1]`; more generally `predictions`'
        shape without its last axis).
      predictions: scores or logits, shape `[N, num_classes]`.
      k: how many top classes count as a hit (`1 <= k <= num_classes`).
      class_id: if given, the recall of this class only: among rows labelled `class_id`, the
        fraction where it is in the top `k`.
      weights: optional scalar or per-row array of shape `[N]`; 0 excludes a row.
      mask: optional keyword, per row; rows where it is 0/False are excluded.

    Returns:
      A `RecallAtK` metric.

    Raises:
      ValueError: on mismatched shapes, non-integer labels, `k` outside `[1, num_classes]`, or
        `class_id` outside `[0, num_classes)`.

    Example:

    >>> import metrics
    >>> scores = [[0.1, 0.5, 0.4], [0.8, 0.1, 0.1]]
    >>> metrics.recall_at_k([2, 2], scores, k=2).compute()
    0.5
    """
    return RecallAtK.from_model_output(labels, predictions, k, class_id, weights, mask=mask)
