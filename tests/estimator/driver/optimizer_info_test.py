"""driver/optimizer_info.py: the learning rate and name of optax optimizers, read from their
closures on the host."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest

import estimator
from estimator.driver import optimizer_info

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.01, 10, 100)

# (optimizer, learning rate as a function of the update count, name); None: cannot be read.
CASES = {
    "adam(constant)": (optax.adam(1e-3), lambda c: 1e-3, "adam"),
    "adam(schedule)": (optax.adam(SCHEDULE), SCHEDULE, "adam"),
    "adamw": (optax.adamw(SCHEDULE), SCHEDULE, "adam+add_decayed_weights"),
    "sgd": (optax.sgd(0.1), lambda c: 0.1, "sgd"),
    "sgd(momentum)": (optax.sgd(SCHEDULE, momentum=0.9), SCHEDULE, "momentum"),
    "rmsprop": (optax.rmsprop(1e-3), lambda c: 1e-3, "rmsprop"),
    "lion": (optax.lion(3e-4), lambda c: 3e-4, "lion+add_decayed_weights"),
    "chain(clip, adam)": (
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(SCHEDULE)),
        SCHEDULE,
        "clip_by_global_norm+adam",
    ),
    "masked": (optax.masked(optax.adam(2e-3), lambda p: p), lambda c: 2e-3, "masked+adam"),
    "written by hand": (
        optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(SCHEDULE), optax.scale(-1.0)),
        SCHEDULE,
        "adam",
    ),
    "CrossShardOptimizer": (
        estimator.CrossShardOptimizer(optax.adam(5e-4)),
        lambda c: 5e-4,
        "adam",
    ),
    "ExponentialMovingAverage": (
        estimator.ExponentialMovingAverage(0.99).apply(optax.adam(SCHEDULE)),
        SCHEDULE,
        None,
    ),
    "multi_transform": (
        optax.multi_transform({"a": optax.adam(1e-3), "b": optax.sgd(0.1)}, lambda p: "a"),
        None,
        None,
    ),
    "inject_hyperparams": (optax.inject_hyperparams(optax.adam)(SCHEDULE), None, "adam"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_learning_rate_is_read_from_the_step_sizes(name):
    tx, rate, _ = CASES[name]
    found = optimizer_info.learning_rate_fn(tx)
    if rate is None:
        assert found is None
        return
    for count in (0, 5, 10, 60):
        assert found.at(count) == pytest.approx(float(rate(count)), rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[2] is not None])
def test_the_optimizer_is_named_by_its_parts(name):
    tx, _, expected = CASES[name]
    assert optimizer_info.optimizer_name(tx) == expected


def test_the_schedule_count_is_the_one_schedule_states_count():
    params = {"w": jnp.zeros(3)}
    state = optax.adam(SCHEDULE).init(params)
    assert optimizer_info.schedule_count(state) == 0
    tx = optax.adam(SCHEDULE)
    _, state = tx.update({"w": jnp.ones(3)}, state, params)
    assert optimizer_info.schedule_count(state) == 1
    assert optimizer_info.schedule_count(optax.adam(1e-3).init(params)) is None  # a constant
