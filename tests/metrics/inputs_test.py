"""Wrong inputs raise clear errors that name the offending argument."""

import numpy as np
import pytest

import metrics

ONES = np.ones(4)
LABELS = np.array([0, 1, 1, 0])
SCORES = np.array([0.1, 0.8, 0.6, 0.3])
LOGITS = np.zeros((4, 3))

ERRORS = [
    # (id, call, exception, regex the message must match)
    ("shape", lambda: metrics.accuracy([1, 2, 3], [1, 2]), ValueError, r"`labels` shape \(3,\)"),
    ("shape_2d", lambda: metrics.mean_squared_error(np.ones((4, 2)), ONES), ValueError, "`labels`"),
    ("weights", lambda: metrics.accuracy(LABELS, LABELS, [1, 2]), ValueError, "`weights` shape"),
    ("weights_3d", lambda: metrics.mean(ONES, np.ones((4, 2))), ValueError, "`weights` shape"),
    ("mask", lambda: metrics.mean(ONES, mask=[1, 0]), ValueError, "`mask` shape"),
    ("values_none", lambda: metrics.mean(None), TypeError, "`values`"),
    ("values_str", lambda: metrics.mean(["a", "b"]), TypeError, "`values`"),
    ("labels_none", lambda: metrics.precision(None, SCORES), TypeError, "`labels`"),
    ("weights_str", lambda: metrics.recall(LABELS, SCORES, "x"), TypeError, "`weights`"),
    ("complex", lambda: metrics.mean(np.ones(2) * 1j), TypeError, "`values`"),
    ("iou_labels", lambda: metrics.mean_iou([0, 3], [0, 1], 3), ValueError, "`labels`.*\\[0, "),
    ("iou_preds", lambda: metrics.mean_iou([0, 1], [0, -1], 3), ValueError, "`predictions`"),
    ("mpca_labels", lambda: metrics.mean_per_class_accuracy([5], [0], 2), ValueError, "`labels`"),
    (
        "mpca_float_ids",
        lambda: metrics.mean_per_class_accuracy([1.5], [1], 2),
        ValueError,
        "`labels` must hold integer",
    ),
    ("num_classes_0", lambda: metrics.mean_iou([0], [0], 0), ValueError, "`num_classes`"),
    ("num_classes_float", lambda: metrics.mean_iou([0], [0], 2.0), TypeError, "`num_classes`"),
    ("auc_range", lambda: metrics.auc(LABELS, SCORES * 2), ValueError, "`predictions`.*\\[0, 1\\]"),
    ("auc_curve", lambda: metrics.auc(LABELS, SCORES, curve="XY"), ValueError, "`curve`"),
    (
        "auc_summation",
        lambda: metrics.auc(LABELS, SCORES, summation_method="simpson"),
        ValueError,
        "`summation_method`",
    ),
    (
        "auc_thresholds",
        lambda: metrics.auc(LABELS, SCORES, None, 1),
        ValueError,
        "`num_thresholds`",
    ),
    (
        "thresholds_2d",
        lambda: metrics.precision(LABELS, SCORES, thresholds=[[0.5]]),
        ValueError,
        "`thresholds`",
    ),
    (
        "thresholds_empty",
        lambda: metrics.recall(LABELS, SCORES, thresholds=[]),
        ValueError,
        "`thresholds`",
    ),
    ("k_zero", lambda: metrics.recall_at_k(LABELS, np.zeros((4, 3)), 0), ValueError, "`k`"),
    ("k_large", lambda: metrics.recall_at_k(LABELS, np.zeros((4, 3)), 4), ValueError, "`k`"),
    ("k_float", lambda: metrics.recall_at_k(LABELS, np.zeros((4, 3)), 1.5), TypeError, "`k`"),
    ("class_id", lambda: metrics.recall_at_k(LABELS, LOGITS, 1, 3), ValueError, "`class_id`"),
    (
        "rak_labels",
        lambda: metrics.recall_at_k(LABELS[:3], LOGITS, 1),
        ValueError,
        "`labels` shape",
    ),
    (
        "rak_weights",
        lambda: metrics.recall_at_k(LABELS, LOGITS, 1, weights=np.ones((4, 3))),
        ValueError,
        "`weights`",
    ),
]


@pytest.mark.parametrize("call, error, match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_inputs_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


MERGE_ERRORS = [
    ("types", metrics.accuracy([1], [1]), metrics.mean([1.0]), TypeError, "Accuracy with Mean"),
    (
        "mse_rmse",
        metrics.mean_squared_error([1.0], [1.0]),
        metrics.root_mean_squared_error([1.0], [1.0]),
        TypeError,
        "MeanSquaredError with RootMeanSquaredError",
    ),
    (
        "tp_fp",
        metrics.true_positives([1], [1]),
        metrics.false_positives([1], [1]),
        TypeError,
        "TruePositives with FalsePositives",
    ),
    ("not_metric", metrics.mean([1.0]), 1.0, TypeError, "`other`"),
    (
        "num_classes",
        metrics.mean_iou([0], [0], 3),
        metrics.mean_iou([0], [0], 4),
        ValueError,
        "`num_classes`: 3 vs 4",
    ),
    ("curve", metrics.auc([1], [0.5]), metrics.auc([1], [0.5], curve="PR"), ValueError, "`curve`"),
    (
        "num_thresholds",
        metrics.auc([1], [0.5]),
        metrics.auc([1], [0.5], None, 100),
        ValueError,
        "`thresholds`",
    ),
    (
        "thresholds",
        metrics.precision([1], [0.5], thresholds=[0.1, 0.2]),
        metrics.precision([1], [0.5], thresholds=[0.1, 0.3]),
        ValueError,
        "`thresholds`",
    ),
    (
        "scalar_vs_list",
        metrics.precision([1], [0.5], thresholds=0.5),
        metrics.precision([1], [0.5], thresholds=[0.5]),
        ValueError,
        "`single_threshold`",
    ),
    (
        "k",
        metrics.recall_at_k([0], [[1.0, 0.0]], 1),
        metrics.recall_at_k([0], [[1.0, 0.0]], 2),
        ValueError,
        "`k`",
    ),
]


@pytest.mark.parametrize(
    "first, second, error, match", [e[1:] for e in MERGE_ERRORS], ids=[e[0] for e in MERGE_ERRORS]
)
def test_bad_merges_say_what_differs(first, second, error, match):
    with pytest.raises(error, match=match):
        first.merge(second)


@pytest.mark.parametrize(
    "weights, shape, expected",
    [
        (None, (2, 3), np.ones((2, 3))),
        (2.0, (2, 3), np.full((2, 3), 2.0)),
        ([1.0, 0.0], (2, 3), [[1, 1, 1], [0, 0, 0]]),
        ([[1.0], [0.0]], (2, 3), [[1, 1, 1], [0, 0, 0]]),
        ([[1.0, 2.0, 3.0]], (2, 3), [[1, 2, 3], [1, 2, 3]]),
        ([[1.0], [2.0]], (2,), [1, 2]),  # TF squeezes a trailing unit axis off weights
    ],
)
def test_weights_broadcast_like_tf(weights, shape, expected):
    from metrics import _inputs

    np.testing.assert_array_equal(_inputs.broadcast_weights(weights, shape), expected)
