"""From an input_fn to staged chunks (``data/feeder.py``): input_fn's params, and every real
row delivered once, in input order, in calls that fit the staging budget.

The reference is the numpy data the input_fn slices; the call lengths are the planner's
arithmetic written out in the test.
"""

from __future__ import annotations

import numpy as np
import pytest

import estimator
from estimator.core.errors import EstimatorValueError
from estimator.core.spec import ModeKeys
from estimator.data.feeder import Feeder
from estimator.data.layout import batch_layouts
from estimator.driver.budget import StepBudget
from estimator.parallel.mesh import make_mesh
from tests import helpers as h

BATCH = 16  # 2 rows per replica
V1, V2 = estimator.InputPipelineConfig.PER_HOST_V1, estimator.InputPipelineConfig.PER_HOST_V2
# One step's input per device: 2 rows x (x: 6 float32 + label int32 + mask float32)
STEP_BYTES = 2 * (6 * 4 + 4 + 4)


def _feeder(tmp_path, *, pipeline=V1, ipl=4, budget=None, sizes=None, params=None) -> Feeder:
    config = h.config(
        tmp_path,
        iterations_per_loop=ipl,
        tpu={"per_host_input_for_training": pipeline, "max_staged_input_bytes": budget},
    )
    mesh = make_mesh()
    sizes = sizes or {ModeKeys.TRAIN: BATCH, ModeKeys.EVAL: BATCH, ModeKeys.PREDICT: BATCH}
    layouts = batch_layouts(sizes, replicas=8, local_replicas=8, pipeline=pipeline, use_tpu=True)
    return Feeder(layouts, params if params is not None else {"lr": 0.1}, config, mesh)


@pytest.mark.parametrize("pipeline, batch_size", [(V1, BATCH), (V2, BATCH // 8)])
def test_input_params_are_a_copy_with_batch_size_and_context(tmp_path, pipeline, batch_size):
    user = {"lr": 0.1, "nested": {"a": [1]}}
    feeder = _feeder(tmp_path, pipeline=pipeline, params=user)
    params = feeder.input_params(ModeKeys.TRAIN)
    assert params["batch_size"] == batch_size and params["lr"] == 0.1
    ctx = params["context"]
    assert ctx.num_replicas == 8 and ctx.mode == ModeKeys.TRAIN
    params["nested"]["a"].append(2)  # input_fn may change its params
    assert user == {"lr": 0.1, "nested": {"a": [1]}}
    assert feeder.input_params(ModeKeys.TRAIN)["nested"] == {"a": [1]}


def test_a_required_batch_size_missing_is_an_error(tmp_path):
    feeder = _feeder(
        tmp_path, sizes={ModeKeys.TRAIN: BATCH, ModeKeys.EVAL: None, ModeKeys.PREDICT: None}
    )
    assert "batch_size" not in feeder.input_params(ModeKeys.EVAL)
    x, y = h.make_data(n=32)
    with pytest.raises(EstimatorValueError, match="eval_batch_size"):
        feeder.pipeline(h.eval_input_fn(x, y), ModeKeys.EVAL, pad=True)


def _collect(feeder: Feeder, input_fn, mode: str, schedule, *, pad: bool, skip: int = 0):
    pipe = feeder.pipeline(input_fn, mode, pad=pad)
    policy = feeder.layout(mode).loop_policy(unrolled=False)
    chunks = feeder.prefetch(pipe, schedule, policy, skip=skip)
    try:
        out = []
        for c in chunks:
            mask = c.host_mask[: c.steps]
            x = np.asarray(c.features["x"])[: c.steps][mask]
            y = np.asarray(c.labels)[: c.steps][mask]
            out.append((c.steps, c.ends_loop, x, y))
        return out
    finally:
        chunks.close()


@pytest.mark.parametrize("pipeline", [V1, V2], ids=["per_host_v1", "per_host_v2"])
@pytest.mark.parametrize(
    "budget_steps, skip, calls",
    [
        # the whole loop of 4 fits: loops of 4 then the last 2 steps to max_steps 6
        (100, 0, [(4, True), (2, True)]),
        # 2 steps fit: each loop as calls of 2
        (2, 0, [(2, False), (2, True), (2, True)]),
        # 3 steps fit a loop of 4: c = 2, divisor 2 needs 2 calls: calls of 2
        (3, 0, [(2, False), (2, True), (2, True)]),
        # two batches consumed before: the chunks start at batch 2
        (100, 2, [(4, True), (2, True)]),
    ],
)
def test_training_chunks_hold_every_batch_once_in_order(
    tmp_path, pipeline, budget_steps, skip, calls
):
    x, y = h.make_data(n=BATCH * 12)
    feeder = _feeder(tmp_path, pipeline=pipeline, budget=budget_steps * STEP_BYTES)
    budget = StepBudget.of(0, steps=None, max_steps=6, hook_targets=(), iterations_per_loop=4)
    got = _collect(
        feeder,
        h.train_input_fn(x, y),
        ModeKeys.TRAIN,
        budget.next_loop,
        pad=False,
        skip=skip * (8 if pipeline == V2 else 1),
    )
    assert [(s, e) for s, e, _, _ in got] == calls
    rows = slice(skip * BATCH, (skip + 6) * BATCH)
    np.testing.assert_array_equal(np.concatenate([g[2] for g in got]), x[rows])
    np.testing.assert_array_equal(np.concatenate([g[3] for g in got]), y[rows])


def test_evaluation_pads_the_last_batch_and_delivers_each_real_row_once(tmp_path):
    x, y = h.make_data(n=BATCH * 5 + 7)  # the sixth batch has 7 real rows
    feeder = _feeder(tmp_path, ipl=4)
    budget = StepBudget.of(0, steps=None, max_steps=None, hook_targets=(), iterations_per_loop=4)
    got = _collect(feeder, h.eval_input_fn(x, y), ModeKeys.EVAL, budget.next_loop, pad=True)
    assert sum(s for s, *_ in got) == 6
    np.testing.assert_array_equal(np.concatenate([g[2] for g in got]), x)
    np.testing.assert_array_equal(np.concatenate([g[3] for g in got]), y)
