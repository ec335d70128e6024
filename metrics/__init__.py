"""Host-side streaming metrics for `eval_metrics`, named as in `tf.compat.v1.metrics`.

A `metric_fn` receives numpy arrays (one evaluation batch, padding already removed) and
returns `{name: metric}`; the estimator merges each name across batches and calls `compute`
once at the end, so results equal a single pass over the whole evaluation set::

    import metrics

    def metric_fn(labels, logits):
        predictions = logits.argmax(-1)
        return {
            "accuracy": metrics.accuracy(labels, predictions),
            "recall_at_5": metrics.recall_at_k(labels, logits, k=5),
            "mean_iou": metrics.mean_iou(labels, predictions, num_classes=10),
        }

    spec = estimator.TPUEstimatorSpec(mode, loss=loss, eval_metrics=(metric_fn, [labels, logits]))

Conventions (TF v1's, unless noted):

* Every factory takes `(labels, predictions, weights=None, ...)` numpy arrays (`mean` takes
  `(values, weights=None)`) and returns a `Metric` for that batch.
* `weights` broadcast to `labels`' shape: a scalar, one weight per row (`[N]`, expanded over
  trailing axes), or any same-rank shape with dimensions 1 or equal. Weight 0 excludes an
  entry exactly, even if its values are NaN. The keyword-only `mask` does the same with
  0/False (CLU's padding mask); pass either or both.
* Division by zero gives 0.0: the value of a metric that saw no (weighted) examples is 0.0,
  never NaN. (TF's `recall_at_k` returns NaN there; we return 0.0 for consistency.)
* Binary metrics (`precision`, `recall`, `true_positives`, ...) cast labels to bool and count
  a prediction as positive when `prediction > threshold`, with threshold 0.5 unless
  `thresholds=` says otherwise (a list gives one value per threshold). For 0/1 or boolean
  predictions this is TF v1's cast to bool; for probabilities it is the usual 0.5 rule.
* `auc` uses TF's thresholded algorithm (200 thresholds by default), so merging is exact and
  it matches TF, while differing slightly from an exact, sorted AUC.
* Scalar metrics `compute()` a python float.

A plain number returned by a `metric_fn` is wrapped with `as_metric(value, num_examples)`, an
example-weighted mean. For your own statistics, subclass `Metric` (see `metrics.base` for
the pattern: a frozen dataclass whose fields add up on `merge`), or use `Sum`/`Mean`, or
`collecting(fn, *arrays)` to keep all rows and compute `fn` on them at the end.

Example:

>>> import numpy as np
>>> import metrics
>>> first = metrics.accuracy(np.array([1, 2]), np.array([1, 0]))
>>> second = metrics.accuracy(np.array([3, 4]), np.array([3, 4]), weights=np.array([1, 0]))
>>> first.merge(second).compute()
0.6666666666666666
"""

from metrics._aggregate import Collecting, Mean, Sum, as_metric, collecting, mean
from metrics._auc import AUC, auc
from metrics._classification import (
    Accuracy,
    MeanIoU,
    MeanPerClassAccuracy,
    accuracy,
    mean_iou,
    mean_per_class_accuracy,
)
from metrics._confusion import (
    FalseNegatives,
    FalsePositives,
    Precision,
    Recall,
    TrueNegatives,
    TruePositives,
    false_negatives,
    false_positives,
    precision,
    recall,
    true_negatives,
    true_positives,
)
from metrics._ranking import RecallAtK, recall_at_k
from metrics._regression import (
    MeanAbsoluteError,
    MeanSquaredError,
    RootMeanSquaredError,
    mean_absolute_error,
    mean_squared_error,
    root_mean_squared_error,
)
from metrics.base import Metric, static_field

__all__ = [
    # Interface and helpers for writing metrics.
    "Metric",
    "static_field",
    "as_metric",
    "Sum",
    "Mean",
    "Collecting",
    "collecting",
    # Factories, named as in tf.compat.v1.metrics.
    "accuracy",
    "auc",
    "false_negatives",
    "false_positives",
    "mean",
    "mean_absolute_error",
    "mean_iou",
    "mean_per_class_accuracy",
    "mean_squared_error",
    "precision",
    "recall",
    "recall_at_k",
    "root_mean_squared_error",
    "true_negatives",
    "true_positives",
    # The metric classes the factories return.
    "AUC",
    "Accuracy",
    "FalseNegatives",
    "FalsePositives",
    "MeanAbsoluteError",
    "MeanIoU",
    "MeanPerClassAccuracy",
    "MeanSquaredError",
    "Precision",
    "Recall",
    "RecallAtK",
    "RootMeanSquaredError",
    "TrueNegatives",
    "TruePositives",
]
