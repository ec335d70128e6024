"""The train_op's learning rate and injected hyperparameters in TensorBoard with no user code
(TensorBoard's own reader), and the default NaN hook's message."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
from estimator.driver import train_hooks
from estimator.driver.train_hooks import NanLossHook, injected_hyperparams
from hooks.base import SessionRunContext, SessionRunValues
from tests import helpers as h
from tests.estimator.driver import tb_reader

SCHEDULE = optax.linear_schedule(0.1, 0.0, 8)


def test_injected_hyperparams_are_found_inside_wrappers():
    params = {"w": jnp.ones(3)}
    sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    wrapped = estimator.ExponentialMovingAverage(0.9).apply(optax.chain(optax.clip(1.0), sgd))
    found = injected_hyperparams(wrapped.init(params))
    assert sorted(found) == ["learning_rate", "momentum"]
    assert float(found["learning_rate"]) == pytest.approx(0.1)
    two = optax.chain(sgd, optax.inject_hyperparams(optax.add_decayed_weights)(1e-4))
    assert sorted(injected_hyperparams(two.init(params))) == [
        "0/learning_rate",
        "0/momentum",
        "1/weight_decay",
    ]
    assert injected_hyperparams(optax.adam(0.1).init(params)) == {}


def model_fn(features, labels, mode, params):
    logits = nn.Dense(3, name="out")(features["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE)
    tx = estimator.ExponentialMovingAverage(0.9).apply(optax.chain(optax.clip(1.0), sgd))
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=tx)


def test_learning_rate_is_written_every_save_summary_steps(tmp_path):
    x, y = h.make_data(n=48)
    est = h.make_estimator(tmp_path, model_fn, ipl=3, save_summary_steps=2)
    est.train(h.train_input_fn(x, y), max_steps=8)
    lr = tb_reader.scalars(tb_reader.multiplexer(tmp_path), ".", "learning_rate")
    # Loops end at steps 3, 6 and 8, each crossing a multiple of 2: the value the loop's last
    # step used (the schedule of its update count, 0-based).
    expected = {3: SCHEDULE(2), 6: SCHEDULE(5), 8: SCHEDULE(7)}
    assert lr == pytest.approx({s: float(v) for s, v in expected.items()})


# ------------------------------------------- any optax optimizer's learning rate (issue 42)
COSINE = optax.cosine_decay_schedule(0.05, 8)


def _model_fn_with(tx):
    def fn(features, labels, mode, params):
        logits = nn.Dense(3, name="out")(features["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=tx)

    return fn


@pytest.mark.parametrize(
    "tx,rate",
    [
        pytest.param(optax.adam(COSINE), COSINE, id="adam(schedule)"),
        pytest.param(optax.adam(1e-3), lambda count: 1e-3, id="adam(constant)"),
        pytest.param(
            estimator.ExponentialMovingAverage(0.9).apply(
                optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(COSINE, momentum=0.9))
            ),
            COSINE,
            id="wrapped sgd(schedule, momentum)",
        ),
    ],
)
def test_the_learning_rate_of_any_optax_optimizer_is_written(tmp_path, tx, rate):
    """Issue 42: only ``optax.inject_hyperparams`` optimizers had their rate written."""
    x, y = h.make_data(n=48)
    est = h.make_estimator(tmp_path, _model_fn_with(tx), ipl=3, save_summary_steps=2)
    est.train(h.train_input_fn(x, y), max_steps=8)
    lr = tb_reader.scalars(tb_reader.multiplexer(tmp_path), ".", "learning_rate")
    expected = {3: rate(2), 6: rate(5), 8: rate(7)}  # as for inject_hyperparams above
    assert lr == pytest.approx({s: float(v) for s, v in expected.items()})


def test_a_rate_that_cannot_be_read_is_one_info_line_saying_how(tmp_path, caplog):
    groups = optax.multi_transform(
        {"a": optax.adam(1e-3), "b": optax.sgd(0.1)},
        lambda params: {"out": {"kernel": "a", "bias": "b"}},
    )
    x, y = h.make_data(n=48)
    est = h.make_estimator(tmp_path, _model_fn_with(groups), ipl=3, save_summary_steps=2)
    train_hooks._UNREADABLE_SAID.clear()
    with caplog.at_level("INFO", logger="estimator"):
        est.train(h.train_input_fn(x, y), max_steps=3)
        est.train(h.train_input_fn(x, y), max_steps=6)  # a second call: said once
    lines = [r.getMessage() for r in caplog.records if "learning rate is not written" in r.message]
    assert len(lines) == 1 and "optax.inject_hyperparams(optax.adam)" in lines[0], lines
    tags = tb_reader.multiplexer(tmp_path).GetAccumulator(".").Tags()["tensors"]
    assert "learning_rate" not in tags


# --------------------------------------------- a NaN loss at step 1 (issue 42: the hint)
def test_a_nan_loss_at_the_first_step_points_at_labels_out_of_range(tmp_path):
    x, y = h.make_data(n=32)
    est = h.make_estimator(tmp_path, ipl=2)
    out_of_range = y * 0 + 7  # 3 classes: class id 7 makes the cross entropy NaN
    with pytest.raises(estimator.NanLossDuringTrainingError) as raised:
        est.train(h.train_input_fn(x, out_of_range), max_steps=2)
    message = str(raised.value)
    assert message.startswith("NaN loss during training at global step 1"), message
    assert "labels out of range for the logits" in message


def test_a_nan_loss_later_has_no_labels_hint():
    hook = NanLossHook("loss")
    ctx = SessionRunContext(None, None, steps=[5, 6])
    with pytest.raises(estimator.NanLossDuringTrainingError) as raised:
        hook.after_run(ctx, SessionRunValues(np.array([0.5, np.nan])))
    assert str(raised.value) == "NaN loss during training at global step 6 (loss = nan)."
