"""The train_op's injected hyperparameters in TensorBoard with no user code (TensorBoard's
own reader)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import optax
import pytest

import estimator
from estimator.driver.train_hooks import injected_hyperparams
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
