"""Two losses, two optimizers in one step (issue 41, item 1): ``estimator.group(
estimator.minimize(d_loss, d_opt, var_list=...), estimator.minimize(g_loss, g_opt, ...))``
trains each variable set on its own loss, exactly as TF's ``tf.group(opt.minimize(...))``, on
8 replicas and one device, under every training option; the naive one-loss port warns."""

from __future__ import annotations

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
from estimator.engine import masked_chain
from tests import helpers as h

B, NOISE, DIM = 16, 64, 16
_RNG = np.random.RandomState(0)
NOISE_BATCH = _RNG.randn(B, NOISE).astype(np.float32)
REAL_BATCH = (_RNG.randn(B, DIM) * 0.5 + 1.0).astype(np.float32)
LR_D, LR_G = 0.1, 0.05


def generator(noise):
    with estimator.variable_scope("Generator", reuse=estimator.AUTO_REUSE):
        return jnp.tanh(nn.Dense(DIM, name="g_fc")(noise))  # 64x16: split under ZeRO


def discriminator(x):
    with estimator.variable_scope("Discriminator", reuse=estimator.AUTO_REUSE):
        h_ = nn.leaky_relu(nn.Dense(64, name="d_h")(x), 0.2)  # 16x64: split under ZeRO
        return nn.Dense(1, name="d_out")(h_)


def losses(d_real, d_fake):
    d_loss = jnp.mean(jax.nn.softplus(-d_real)) + jnp.mean(jax.nn.softplus(d_fake))
    g_loss = jnp.mean(jax.nn.softplus(-d_fake))
    return d_loss, g_loss


def _optimizers(params):
    if params.get("adam"):
        return optax.adam(1e-2, b1=0.5), optax.adam(1e-2, b1=0.5)
    return optax.sgd(LR_D), optax.sgd(LR_G)


def _train_op(params, d_loss, g_loss):
    d_opt, g_opt = _optimizers(params)
    kind = params.get("train_op", "group")
    if kind == "group":  # names as patterns, and trainable_variables() entries
        return estimator.group(
            estimator.minimize(d_loss, d_opt, var_list="Discriminator"),
            estimator.minimize(
                g_loss, g_opt, var_list=estimator.trainable_variables(scope="Generator")
            ),
        )
    d_mask = estimator.name_mask("^Discriminator/")
    g_mask = estimator.name_mask("^Generator/")
    chain = optax.chain(optax.masked(d_opt, d_mask), optax.masked(g_opt, g_mask))
    variants = {  # built lazily: calling minimize() is what model_fn declares
        "naive": lambda: chain,
        "intended": lambda: estimator.minimize(g_loss, chain),
        "wrapped": lambda: optax.chain(
            optax.identity(), estimator.group(estimator.minimize(g_loss, g_opt))
        ),
        "overlap": lambda: estimator.group(
            estimator.minimize(d_loss, d_opt), estimator.minimize(g_loss, g_opt, var_list="Gen")
        ),
        "empty": lambda: estimator.minimize(d_loss, d_opt, var_list="Critic"),
        "ema": lambda: estimator.ExponentialMovingAverage(0.9).apply(
            estimator.group(
                estimator.minimize(d_loss, d_opt, var_list="Discriminator"),
                estimator.minimize(g_loss, g_opt, var_list="Generator"),
            )
        ),
    }
    return variants[kind]()


def model_fn(features, labels, mode, params):
    fake = generator(features["noise"])
    d_loss, g_loss = losses(discriminator(labels), discriminator(fake))
    return estimator.TPUEstimatorSpec(mode, loss=g_loss, train_op=_train_op(params, d_loss, g_loss))


def input_fn(params):
    del params
    return {"noise": NOISE_BATCH}, REAL_BATCH  # one batch, repeated every step (TF's rule)


def _train(tmp_path, name, steps=3, *, use_tpu=True, params=None, **tpu):
    est = h.make_estimator(
        tmp_path / name, model_fn, batch=B, ipl=steps, params=params, use_tpu=use_tpu, tpu=tpu
    )
    return est.train(input_fn, max_steps=steps)


def _weights(est):
    """The model's weights (not global_step, not moving averages)."""
    names = est.get_variable_names()
    return {n: est.get_variable_value(n) for n in names if "/" in n and "Moving" not in n}


def _hand_step(p, lr_d=LR_D, lr_g=LR_G):
    """TF's step by hand: d_loss's gradient w.r.t. D, g_loss's w.r.t. G, at the same weights."""

    def apply(p, x, scope):
        k, b = p[f"{scope}/kernel"], p[f"{scope}/bias"]
        return x @ k + b

    def d(p, x):
        return apply(p, nn.leaky_relu(apply(p, x, "Discriminator/d_h"), 0.2), "Discriminator/d_out")

    def both(p):
        fake = jnp.tanh(apply(p, NOISE_BATCH, "Generator/g_fc"))
        return losses(d(p, REAL_BATCH), d(p, fake))

    gd = jax.grad(lambda p: both(p)[0])(p)
    gg = jax.grad(lambda p: both(p)[1])(p)
    return {
        k: v - (lr_d * gd[k] if k.startswith("Discriminator") else lr_g * gg[k])
        for k, v in p.items()
    }


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    """Three Adam steps on 8 replicas: the reference of the equivalence tests."""
    est = _train(tmp_path_factory.mktemp("multi_loss"), "r8", params={"adam": True})
    return _weights(est)


def test_each_loss_trains_only_its_variables_as_tf(tmp_path):
    est = _train(tmp_path, "one", steps=1, use_tpu=False)
    before = {k: jnp.asarray(v) for k, v in _weights(est).items()}
    est.train(input_fn, steps=1)
    after = _weights(est)
    assert int(est.get_variable_value("global_step")) == 2  # advanced once per step
    h.assert_params_close(after, _hand_step(before), rtol=1e-5, atol=1e-6)


def test_eight_replicas_match_one_device(tmp_path, replicated):
    one = _weights(_train(tmp_path, "r1", use_tpu=False, params={"adam": True}))
    h.assert_params_close(replicated, one, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "option",
    [
        {"shard_optimizer_state": True},  # ZeRO-1
        {"shard_params": True},  # FSDP
        {"num_microbatches": 2},
    ],
    ids=["zero1", "fsdp", "microbatches"],
)
def test_sharded_and_micro_batched_runs_match_replicated(tmp_path, replicated, option):
    got = _weights(_train(tmp_path, "opt", params={"adam": True}, **option))
    h.assert_params_close(got, replicated, rtol=1e-5, atol=1e-6)


def test_float16_loss_scaling_scales_every_loss(tmp_path, replicated):
    est = _train(tmp_path, "f16", params={"adam": True}, compute_dtype="float16")
    assert int(est.get_variable_value("global_step")) == 3
    # every step kept (no overflow at the initial scale), close to the float32 run
    h.assert_params_close(_weights(est), replicated, atol=2e-2)


def test_moving_average_of_a_group(tmp_path, replicated):
    est = _train(tmp_path, "ema", params={"adam": True, "train_op": "ema"})
    h.assert_params_close(_weights(est), replicated, rtol=1e-5, atol=1e-6)
    shadow = estimator.load_variable(
        est.model_dir, "Generator/g_fc/kernel/ExponentialMovingAverage"
    )
    raw = replicated["Generator/g_fc/kernel"]
    assert np.all(np.isfinite(shadow)) and not np.allclose(shadow, raw)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("overlap", "both train Generator/g_fc"),
        ("empty", "selects no variable"),
        ("wrapped", "return the group itself"),
    ],
)
def test_ill_formed_groups_are_refused_by_name(tmp_path, kind, message):
    with pytest.raises(estimator.EstimatorError, match=message):
        _train(tmp_path, kind, steps=1, params={"train_op": kind})


def test_group_refuses_what_is_not_a_minimize():
    with pytest.raises(TypeError, match="drop TF's increment_step"):
        estimator.group(estimator.minimize(jnp.float32(0), optax.sgd(1.0)), jnp.int32(1))
    with pytest.raises(TypeError, match="optax GradientTransformation"):
        estimator.minimize(jnp.float32(0), "adam")


def test_the_naive_one_loss_port_warns_once_and_intended_is_quiet(tmp_path, caplog):
    masked_chain._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="estimator"):
        est = _train(tmp_path, "naive", steps=1, params={"train_op": "naive", "adam": True})
        est.train(input_fn, steps=1)
    warned = [r.getMessage() for r in caplog.records if "optax.masked" in r.getMessage()]
    assert len(warned) == 1
    assert "[Discriminator/* (4 variables)] and [Generator/g_fc/* (2 variables)]" in warned[0]
    assert "estimator.group(estimator.minimize(d_loss" in warned[0]
    caplog.clear()
    masked_chain._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="estimator"):
        _train(tmp_path, "intended", steps=1, params={"train_op": "intended", "adam": True})
    assert "optax.masked" not in caplog.text


def _chains(tx, params):
    return masked_chain.masked_chains(jax.eval_shape(tx.init, params), params)


def test_only_masked_optimizers_with_state_over_disjoint_sets_are_flagged():
    params = {
        "D": {"k": jnp.zeros((3, 2)), "b": jnp.zeros(2)},
        "G": {"k": jnp.zeros((4, 3))},
    }
    d_mask = {"D": True, "G": False}  # a prefix mask, as optax allows
    g_mask = estimator.name_mask("^G/")
    adam = optax.adam(1e-3)
    flagged = _chains(optax.chain(optax.masked(adam, d_mask), optax.masked(adam, g_mask)), params)
    assert flagged == [[{"D/k", "D/b"}, {"G/k"}]]
    # the freeze idiom, adamw's own mask, optax's parameter groups and overlaps are not
    frozen = optax.chain(optax.masked(optax.set_to_zero(), g_mask), adam)
    assert _chains(frozen, params) == []
    assert _chains(optax.adamw(1e-3, mask=d_mask), params) == []
    labels = {"D": "d", "G": "g"}
    assert _chains(optax.multi_transform({"d": adam, "g": adam}, labels), params) == []
    both = optax.chain(optax.masked(adam, d_mask), optax.masked(optax.sgd(1e-3, 0.9), d_mask))
    assert _chains(both, params) == []
