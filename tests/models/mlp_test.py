"""Optimizer and schedule choices shared by the zoo's model_fns."""

import numpy as np
import optax
import pytest

from models.mlp import make_optimizer


def test_cosine_decay_without_warmup():
    _, lr = make_optimizer({"learning_rate": 0.1, "decay_steps": 100})
    assert float(lr(0)) == pytest.approx(0.1)
    assert float(lr(100)) == pytest.approx(0.005)  # alpha=0.05


def test_warmup_rises_linearly_then_decays_to_5_percent():
    _, lr = make_optimizer({"learning_rate": 0.2, "decay_steps": 100, "warmup_steps": 10})
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(0.1)
    assert float(lr(10)) == pytest.approx(0.2)
    assert float(lr(100)) == pytest.approx(0.01)


def test_momentum_is_nesterov_sgd_with_decoupled_weight_decay():
    tx, _ = make_optimizer(
        {"learning_rate": 0.1, "decay_steps": 1000, "optimizer": "momentum", "weight_decay": 0.5}
    )
    params, grads = {"w": np.ones(3, np.float32)}, {"w": np.full(3, 2.0, np.float32)}
    updates, _ = tx.update(grads, tx.init(params), params)
    # Nesterov, first step: g' = g + wd*w = 2.5, v = g'; update = -lr * (g' + 0.9 v) = -0.475
    np.testing.assert_allclose(updates["w"], -0.475, rtol=1e-6)
    ref = optax.chain(optax.add_decayed_weights(0.5), optax.sgd(0.1, momentum=0.9, nesterov=True))
    expected, _ = ref.update(grads, ref.init(params), params)
    np.testing.assert_allclose(updates["w"], expected["w"], rtol=1e-6)


def test_unknown_optimizer_is_named():
    with pytest.raises(ValueError, match="'lamb'"):
        make_optimizer({"learning_rate": 0.1, "optimizer": "lamb"})
