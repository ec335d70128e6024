"""TPUConfig(num_microbatches=k): k micro-batches per replica per step, one update; equal to
k=1 without BatchNorm; global_step counts updates; optax.MultiSteps refused naming it."""

from __future__ import annotations

import itertools

import numpy as np
import optax
import pytest

import estimator
import hooks
from tests import helpers as h


def _params_after(model_dir, *, steps=20, batch=64, use_tpu=True, model_fn=h.model_fn, **tpu):
    x, y = h.make_data(n=128)
    est = h.make_estimator(
        model_dir, model_fn, batch=batch, ipl=5, use_tpu=use_tpu, tpu=tpu, params={"lr": 0.2}
    )
    est.train(h.train_input_fn(x, y), max_steps=steps)
    return h.params_of(est)


@pytest.mark.parametrize("use_tpu", [True, False], ids=["8_devices", "1_device"])
def test_four_microbatches_equal_one_after_20_sgd_steps(use_tpu, tmp_path):
    one = _params_after(tmp_path / "k1", use_tpu=use_tpu)
    four = _params_after(tmp_path / "k4", use_tpu=use_tpu, num_microbatches=4)
    assert one["global_step"] == four["global_step"] == 20  # updates, not micro-batches
    h.assert_params_close(one, four, rtol=1e-5, atol=1e-6)  # up to float reassociation


def test_microbatches_with_sharded_optimizer_state_and_params(tmp_path):
    one = _params_after(tmp_path / "k1", steps=10)
    for name, tpu in {
        "zero1": {"shard_optimizer_state": True},
        "zero3": {"shard_params": True},
    }.items():
        got = _params_after(tmp_path / name, steps=10, num_microbatches=2, **tpu)
        h.assert_params_close(one, got, rtol=1e-5, atol=1e-6)


def test_microbatches_with_bfloat16_keep_float32_state(tmp_path):
    one = _params_after(tmp_path / "k1", steps=10, compute_dtype="bfloat16")
    two = _params_after(tmp_path / "k2", steps=10, compute_dtype="bfloat16", num_microbatches=2)
    assert {np.asarray(v).dtype for k, v in two.items() if k != "global_step"} == {
        np.dtype(np.float32)
    }
    h.assert_params_close(one, two, rtol=2e-2, atol=2e-2)  # bf16 rounding, reassociated


def test_batchnorm_statistics_thread_through_the_microbatches(tmp_path):
    """Each micro-batch is normalised by its own statistics and the moving averages are
    updated once per micro-batch: equal to k=1 run on batches of rows / k, k times as many
    steps of statistics (checked against a 1-device numpy EMA of the micro-batch means)."""
    x, y = h.make_data(n=64)
    est = h.make_estimator(
        tmp_path,
        batch=32,
        ipl=1,
        use_tpu=False,
        tpu={"num_microbatches": 4},
        params={"batch_norm": True, "lr": 0.0},  # lr 0: the hidden layer stays at its init
    )
    est.train(h.train_input_fn(x, y), max_steps=1)
    p = h.params_of(est)
    hidden = x[:32] @ p["hidden/kernel"] + p["hidden/bias"]
    mean = np.zeros(hidden.shape[1], np.float32)
    for rows in np.split(hidden, 4):  # momentum 0.9, applied per micro-batch, in order
        mean = 0.9 * mean + 0.1 * rows.mean(0)
    np.testing.assert_allclose(p["batch_stats/BatchNorm_0/mean"], mean, rtol=1e-5, atol=1e-6)
    assert p["global_step"] == 1


def test_global_step_counts_updates_and_input_is_pulled_once_per_step(tmp_path):
    x, y = h.make_data(n=128)
    pulls = []

    def input_fn(params):
        for batch in h.train_input_fn(x, y)(params):
            pulls.append(1)
            yield batch

    est = h.make_estimator(tmp_path, batch=64, ipl=4, tpu={"num_microbatches": 4})
    est.train(input_fn, max_steps=8)
    assert h.params_of(est)["global_step"] == 8
    assert 8 <= len(pulls) <= 8 + 4 * 2  # 8 steps' batches (plus what prefetching reads)


def test_host_call_sees_every_row_in_input_order(tmp_path):
    x, y = h.make_data(n=64)
    got = []

    def model_fn(features, labels, mode, params):
        spec = h.model_fn(features, labels, mode, params)
        return estimator.TPUEstimatorSpec(
            mode,
            loss=spec.loss,
            train_op=spec.train_op,
            host_call=(lambda rows: got.append(np.asarray(rows)), [features["row"]]),
        )

    def input_fn(params):
        b = params["batch_size"]
        for i in range(0, len(x), b):
            yield {"x": x[i : i + b], "row": np.arange(i, i + b, dtype=np.int32)}, y[i : i + b]

    est = h.make_estimator(tmp_path, model_fn, batch=32, ipl=2, tpu={"num_microbatches": 2})
    est.train(input_fn, max_steps=2)
    np.testing.assert_array_equal(np.concatenate(got), np.arange(64))


def test_skip_nonfinite_steps_skips_the_whole_step(tmp_path):
    x, y = h.make_data(n=128)
    batches = list(itertools.islice(h.train_input_fn(x, y)({"batch_size": 64}), 6))
    bad = [dict(b[0]) for b in batches[:1]][0]
    bad["x"] = bad["x"].copy()
    bad["x"][63, 0] = np.nan  # the last micro-batch of the last replica
    with_bad = batches[:2] + [(bad, batches[0][1])] + batches[3:]
    kw = {"batch": 64, "ipl": 1, "params": {"lr": 0.2}}
    est = h.make_estimator(
        tmp_path / "skip", skip_nonfinite_steps=True, tpu={"num_microbatches": 4}, **kw
    )
    est.train(lambda params: iter(with_bad), max_steps=6)
    reference = h.make_estimator(tmp_path / "ref", **kw)
    reference.train(lambda params: iter(batches[:2] + batches[3:]), max_steps=5)
    got, want = h.params_of(est), h.params_of(reference)
    assert got.pop("global_step") == 6 and want.pop("global_step") == 5
    h.assert_params_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_batch_k_does_not_divide_is_a_clear_error(tmp_path):
    x, y = h.make_data()
    est = h.make_estimator(tmp_path, batch=48, tpu={"num_microbatches": 4})  # 6 rows/replica
    with pytest.raises(ValueError, match=r"num_microbatches=4.*\(6 rows\)"):
        est.train(h.train_input_fn(x, y), max_steps=1)


def _model_fn_with(train_op):
    def model_fn(features, labels, mode, params):
        spec = h.model_fn(features, labels, mode, params)
        return estimator.TPUEstimatorSpec(mode, loss=spec.loss, train_op=train_op)

    return model_fn


@pytest.mark.parametrize("gradient_transformation", [False, True], ids=["object", "gt"])
def test_multisteps_is_refused_naming_num_microbatches(gradient_transformation, tmp_path):
    multi = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4)
    tx = multi.gradient_transformation() if gradient_transformation else multi
    x, y = h.make_data()
    est = h.make_estimator(tmp_path, _model_fn_with(tx), batch=16)
    with pytest.raises(TypeError, match="num_microbatches"):
        est.train(h.train_input_fn(x, y), max_steps=1)


class _Losses(hooks.SessionRunHook):
    def __init__(self):
        self.losses = []

    def before_run(self, run_context):
        return hooks.SessionRunArgs("loss")

    def after_run(self, run_context, run_values):
        self.losses.extend(np.asarray(run_values.results).reshape(-1).tolist())


def test_reported_loss_is_the_mean_over_microbatches(tmp_path):
    x, y = h.make_data(n=128)
    losses = {}
    for k in (1, 4):
        est = h.make_estimator(tmp_path / str(k), batch=64, ipl=2, tpu={"num_microbatches": k})
        hook = _Losses()
        est.train(h.train_input_fn(x, y), max_steps=4, hooks=[hook])
        losses[k] = hook.losses
    assert len(losses[4]) == 4
    np.testing.assert_allclose(losses[1], losses[4], rtol=1e-5)
