"""BatchLayout: the batch arithmetic of every pipeline mode, against hand-computed tables."""

from __future__ import annotations

import numpy as np
import pytest

from estimator import InputPipelineConfig as IPC
from estimator.core.errors import EstimatorError
from estimator.data.layout import BatchLayout, check_batch_size

# (pipeline, global, replicas, local replicas, processes) ->
#   (input_fn batch_size, process rows, pulls per step, rows per pull, copies)
TABLE = [
    ("v1 one process", IPC.PER_HOST_V1, 64, 8, 8, 1, (64, 64, 1, 64, 1)),
    ("v1 two processes", IPC.PER_HOST_V1, 64, 8, 4, 2, (32, 32, 1, 32, 1)),
    ("v2 one process", IPC.PER_HOST_V2, 64, 8, 8, 1, (8, 64, 8, 8, 1)),
    ("v2 two processes", IPC.PER_HOST_V2, 64, 8, 4, 2, (8, 32, 4, 8, 1)),
    ("per shard = v2", IPC.PER_SHARD_V1, 64, 8, 8, 1, (8, 64, 8, 8, 1)),
    ("broadcast", IPC.BROADCAST, 12, 8, 8, 1, (12, 12, 1, 12, 8)),
    ("broadcast two processes", IPC.BROADCAST, 12, 8, 4, 2, (12, 12, 1, 12, 4)),
]


@pytest.mark.parametrize(
    "pipeline, rows, replicas, local, processes, expected",
    [t[1:] for t in TABLE],
    ids=[t[0] for t in TABLE],
)
def test_batch_arithmetic(pipeline, rows, replicas, local, processes, expected):
    layout = BatchLayout("train", rows, replicas, local, processes, pipeline)
    got = (
        layout.input_batch_size,
        layout.process_rows,
        layout.pulls_per_step,
        layout.rows_per_pull,
        layout.copies,
    )
    assert got == expected


def test_unknown_batch_size_is_taken_from_the_first_batch_unless_required():
    free = BatchLayout("eval", None, 1, 1, 1, IPC.PER_HOST_V1)
    assert free.input_batch_size is None and free.rows_per_pull is None
    free.check_given()
    required = BatchLayout("eval", None, 8, 8, 1, IPC.PER_HOST_V1, required=True)
    with pytest.raises(ValueError, match="eval_batch_size must be set to run eval"):
        required.check_given()


def test_broadcast_counts_each_row_once():
    layout = BatchLayout("eval", 2, 4, 4, 1, IPC.BROADCAST)
    mask = np.tile(np.array([True, False]), (3, 4))  # 3 steps, 4 replicas x 2 rows
    kept = layout.count_once(mask)
    assert kept.sum() == 3 and kept[:, :2].tolist() == [[True, False]] * 3
    plain = BatchLayout("eval", 8, 4, 4, 1, IPC.PER_HOST_V1)
    assert plain.count_once(mask) is mask


CHECKS = [
    ("missing", None, True, 8, IPC.PER_HOST_V1, ValueError, "must be set when use_tpu=True"),
    ("bool", True, False, 8, IPC.PER_HOST_V1, TypeError, "must be an int"),
    ("zero", 0, False, 8, IPC.PER_HOST_V1, ValueError, "must be positive"),
    ("indivisible", 12, False, 8, IPC.PER_HOST_V1, ValueError, "not divisible by the number"),
]


@pytest.mark.parametrize(
    "value, required, replicas, pipeline, error, match",
    [c[1:] for c in CHECKS],
    ids=[c[0] for c in CHECKS],
)
def test_batch_size_errors_name_the_argument(value, required, replicas, pipeline, error, match):
    with pytest.raises(error, match=f"train_batch_size.*{match}|{match}") as info:
        check_batch_size(
            "train_batch_size", value, required=required, replicas=replicas, pipeline=pipeline
        )
    assert isinstance(info.value, EstimatorError) and "train_batch_size" in str(info.value)


def test_broadcast_batch_need_not_divide_over_replicas():
    assert check_batch_size("b", 12, required=False, replicas=8, pipeline=IPC.BROADCAST) == 12
