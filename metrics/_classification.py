"""Multi-class metrics: `accuracy`, `mean_per_class_accuracy`, `mean_iou`.

`accuracy` compares `labels == predictions` elementwise; the two per-class metrics take
integer class ids and accumulate per-class sums or a confusion matrix, so merging is exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from metrics import _inputs
from metrics._aggregate import _Elementwise
from metrics._inputs import ArrayLike
from metrics.base import Metric, static_field


@dataclasses.dataclass(frozen=True, eq=False)
class Accuracy(_Elementwise):
    """State of `metrics.accuracy`: weighted count of correct entries over total weight."""

    @staticmethod
    def _values(labels: np.ndarray, predictions: np.ndarray) -> np.ndarray:
        return (labels == predictions).astype(np.float64)


def accuracy(
    labels: ArrayLike,
    predictions: ArrayLike,
    weights: ArrayLike | None = None,
    *,
    mask: ArrayLike | None = None,
) -> Accuracy:
    """How often `predictions` equals `labels`, elementwise (`tf.compat.v1.metrics.accuracy`).

    Pass class ids, not logits: e.g. `accuracy(labels, np.argmax(logits, -1))`.

    Args:
      labels: array of the same shape as `predictions` (a trailing axis of size 1 on either
        side is squeezed, as TF does).
      predictions: array of any shape.
      weights: optional scalar or array broadcastable to `labels` (per-row `[N]` weights are
        expanded over trailing dimensions); 0 excludes an entry.
      mask: optional keyword; entries where it is 0/False are excluded.

    Returns:
      An `Accuracy`; `compute()` is 0.0 when the weights sum to 0.

    Raises:
      ValueError: if the shapes of `labels`, `predictions` or `weights` do not match.

    Example:

    >>> import metrics
    >>> metrics.accuracy([1, 2, 3, 4], [1, 2, 0, 0]).compute()
    0.5
    """
    return Accuracy.from_model_output(labels, predictions, weights, mask=mask)


def _flat_class_inputs(
    labels: ArrayLike,
    predictions: ArrayLike,
    num_classes: int,
    weights: ArrayLike | None,
    mask: ArrayLike | None,
    *,
    check_predictions: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flattened (labels, predictions, weights) of a per-class metric, checked."""
    labels_array, predictions_array = _inputs.labels_and_predictions(labels, predictions)
    w = _inputs.broadcast_weights(weights, labels_array.shape, mask=mask).reshape(-1)
    label_ids = _inputs.class_ids(labels_array.reshape(-1), w, "labels", num_classes)
    limit = num_classes if check_predictions else None
    prediction_ids = _inputs.class_ids(predictions_array.reshape(-1), w, "predictions", limit)
    return label_ids, prediction_ids, w


@dataclasses.dataclass(frozen=True, eq=False)
class MeanPerClassAccuracy(Metric):
    """State of `metrics.mean_per_class_accuracy`.

    Attributes:
      total: `[num_classes]` total weight of the examples of each (true) class.
      correct: `[num_classes]` weight of the correctly predicted examples of each class.
      num_classes: the number of classes.
    """

    total: np.ndarray
    correct: np.ndarray
    num_classes: int = static_field()

    @classmethod
    def empty(cls, num_classes: int) -> MeanPerClassAccuracy:
        n = _inputs.positive_int(num_classes, "num_classes")
        return cls(np.zeros(n), np.zeros(n), n)

    @classmethod
    def from_model_output(
        cls,
        labels: ArrayLike,
        predictions: ArrayLike,
        num_classes: int,
        weights: ArrayLike | None = None,
        *,
        mask: ArrayLike | None = None,
    ) -> MeanPerClassAccuracy:
        """Same as `metrics.mean_per_class_accuracy`."""
        n = _inputs.positive_int(num_classes, "num_classes")
        label_ids, prediction_ids, w = _flat_class_inputs(
            labels, predictions, n, weights, mask, check_predictions=False
        )
        total = np.bincount(label_ids, weights=w, minlength=n).astype(np.float64)
        hits = np.where(label_ids == prediction_ids, w, 0.0)
        correct = np.bincount(label_ids, weights=hits, minlength=n).astype(np.float64)
        return cls(total, correct, n)

    def per_class(self) -> np.ndarray:
        """Returns the `[num_classes]` accuracies (0 for classes never seen)."""
        safe = np.where(self.total > 0, self.total, 1.0)
        return np.where(self.total > 0, self.correct / safe, 0.0)

    def compute(self) -> float:
        return float(np.mean(self.per_class()))


def mean_per_class_accuracy(
    labels: ArrayLike,
    predictions: ArrayLike,
    num_classes: int,
    weights: ArrayLike | None = None,
    *,
    mask: ArrayLike | None = None,
) -> MeanPerClassAccuracy:
    """The mean over classes of each class's accuracy (recall), as in TF v1.

    As in TF, the mean runs over all `num_classes` classes: a class with no (weighted) examples
    contributes an accuracy of 0. Inputs of any rank are flattened.

    Args:
      labels: integer class ids in `[0, num_classes)`.
      predictions: integer class ids, same shape as `labels` (out-of-range ids count as wrong).
      num_classes: the number of classes.
      weights: optional scalar or array broadcastable to `labels`; 0 excludes an entry (its
        label is then not checked).
      mask: optional keyword; entries where it is 0/False are excluded.

    Returns:
      A `MeanPerClassAccuracy`; `per_class()` gives the per-class accuracies.

    Raises:
      ValueError: on mismatched shapes, non-integer ids, or `labels` outside
        `[0, num_classes)`.

    Example:

    >>> import metrics
    >>> metrics.mean_per_class_accuracy([0, 0, 1, 1], [0, 1, 1, 1], num_classes=2).compute()
    0.75
    """
    return MeanPerClassAccuracy.from_model_output(
        labels, predictions, num_classes, weights, mask=mask
    )


@dataclasses.dataclass(frozen=True, eq=False)
class MeanIoU(Metric):
    """State of `metrics.mean_iou`.

    Attributes:
      confusion: `[num_classes, num_classes]` weights; rows are labels, columns predictions.
      num_classes: the number of classes.
    """

    confusion: np.ndarray
    num_classes: int = static_field()

    @classmethod
    def empty(cls, num_classes: int) -> MeanIoU:
        n = _inputs.positive_int(num_classes, "num_classes")
        return cls(np.zeros((n, n)), n)

    @classmethod
    def from_model_output(
        cls,
        labels: ArrayLike,
        predictions: ArrayLike,
        num_classes: int,
        weights: ArrayLike | None = None,
        *,
        mask: ArrayLike | None = None,
    ) -> MeanIoU:
        """Same as `metrics.mean_iou`."""
        n = _inputs.positive_int(num_classes, "num_classes")
        label_ids, prediction_ids, w = _flat_class_inputs(
            labels, predictions, n, weights, mask, check_predictions=True
        )
        flat = np.bincount(label_ids * n + prediction_ids, weights=w, minlength=n * n)
        return cls(flat.astype(np.float64).reshape(n, n), n)

    def per_class(self) -> np.ndarray:
        """Returns the `[num_classes]` IoUs (0 for classes absent from labels and predictions)."""
        diagonal = np.diag(self.confusion)
        union = self.confusion.sum(0) + self.confusion.sum(1) - diagonal
        return np.where(union > 0, diagonal / np.where(union > 0, union, 1.0), 0.0)

    def compute(self) -> float:
        diagonal = np.diag(self.confusion)
        union = self.confusion.sum(0) + self.confusion.sum(1) - diagonal
        valid = np.count_nonzero(union)
        return float(np.sum(self.per_class()) / valid) if valid else 0.0


def mean_iou(
    labels: ArrayLike,
    predictions: ArrayLike,
    num_classes: int,
    weights: ArrayLike | None = None,
    *,
    mask: ArrayLike | None = None,
) -> MeanIoU:
    """The mean intersection-over-union over classes (`tf.compat.v1.metrics.mean_iou`).

    IoU of a class is `TP / (TP + FP + FN)` from the weighted confusion matrix; as in TF, the
    mean runs over the classes that appear in labels or predictions (others are skipped),
    and is 0 when no class appears. Inputs of any rank are flattened.

    Args:
      labels: integer class ids in `[0, num_classes)`.
      predictions: integer class ids in `[0, num_classes)`, same shape as `labels`.
      num_classes: the number of classes.
      weights: optional scalar or array broadcastable to `labels`; 0 excludes an entry.
      mask: optional keyword; entries where it is 0/False are excluded.

    Returns:
      A `MeanIoU`; `per_class()` gives the per-class IoUs.

    Raises:
      ValueError: on mismatched shapes, non-integer ids, or ids outside `[0, num_classes)`.

    Example:

    >>> import metrics
    >>> metrics.mean_iou([0, 0, 1, 1], [0, 1, 1, 1], num_classes=3).compute()
    0.5833333333333333
    """
    return MeanIoU.from_model_output(labels, predictions, num_classes, weights, mask=mask)
