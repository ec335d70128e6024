"""``trainable_variables()`` and ``get_or_create_global_step()`` inside model_fn (issue 27,
items 2 and 7), written as the tensorflow/tpu vision mains and BERT write them."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
import estimator.weights.trainable
from tests import helpers as h

X, Y = h.make_data(n=64, d=6, classes=3, seed=5)
SEEN: dict = {}


def model_fn(features, labels, mode, params):
    """ResNet's loss: cross entropy plus L2 over every trainable variable except batch norm's
    (``tf.add_n([tf.nn.l2_loss(tf.cast(v, tf.float32)) for v in tf.trainable_variables()
    if 'batch_normalization' not in v.name])``)."""
    x = nn.Dense(8, name="hidden")(features["x"])
    x = nn.BatchNorm(use_running_average=mode != estimator.ModeKeys.TRAIN, axis_name="data")(x)
    logits = nn.Dense(3, name="out")(nn.relu(x))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    tvars = estimator.trainable_variables()
    SEEN.setdefault(mode, [v.name for v in tvars])
    loss = loss + params["weight_decay"] * sum(
        jnp.sum(v.astype(jnp.float32) ** 2) / 2 for v in tvars if "BatchNorm" not in v.name
    )
    gs = estimator.get_or_create_global_step()
    SEEN["global_step_shape"] = jnp.reshape(gs, [1]).shape
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.5))


def _trained(tmp_path, weight_decay, steps=8):
    est = h.make_estimator(tmp_path, model_fn, params={"weight_decay": weight_decay})
    est.train(h.train_input_fn(X, Y), max_steps=steps)
    return est


def test_weight_decay_over_trainable_variables_shrinks_the_kernels(tmp_path):
    plain = _trained(tmp_path / "plain", 0.0)
    decayed = _trained(tmp_path / "decayed", 0.5)
    for name in ("hidden/kernel", "out/kernel"):
        assert np.linalg.norm(decayed.get_variable_value(name)) < 0.9 * np.linalg.norm(
            plain.get_variable_value(name)
        ), name
    # The batch norm scale is left out of the decay, as the program asks.
    assert "BatchNorm_0/scale:0" in SEEN[estimator.ModeKeys.TRAIN]


def test_names_are_tfs_and_match_the_checkpoints(tmp_path):
    """BERT's ``get_assignment_map_from_checkpoint`` strips ``:0`` and looks the names up in
    ``list_variables``: every trainable variable is found (batch statistics are not trainable)."""
    est = _trained(tmp_path, 0.0, steps=2)
    names = SEEN[estimator.ModeKeys.TRAIN]
    assert all(n.endswith(":0") for n in names)
    stripped = [re.match("^(.*):\\d+$", n).group(1) for n in names]
    saved = {n for n, _ in estimator.list_variables(est.model_dir)}
    assert set(stripped) <= saved
    model_vars = set(est.get_variable_names()) - {"global_step"}
    assert set(stripped) == {n for n in model_vars if not n.startswith("batch_stats/")}
    assert SEEN["global_step_shape"] == (1,)


def test_a_variable_acts_as_its_array():
    v = estimator.weights.trainable.Variable("dense/kernel:0", jnp.arange(6.0).reshape(2, 3))
    np.testing.assert_allclose(v * 2, np.arange(6.0).reshape(2, 3) * 2)
    np.testing.assert_allclose(2 - v, 2 - np.arange(6.0).reshape(2, 3))
    assert v.shape == (2, 3) and v.sum() == 15.0 and v[1, 2] == 5.0
    np.testing.assert_allclose(jnp.asarray(v), np.asarray(v))
    assert jax.tree.leaves([v])[0] is v.value  # a pytree node over its array
    assert optax.tree.norm([v]) == pytest.approx(float(np.sqrt((np.arange(6.0) ** 2).sum())))


def test_outside_model_fn_they_say_where_they_work():
    with pytest.raises(RuntimeError, match="inside model_fn"):
        estimator.trainable_variables()
    with pytest.raises(RuntimeError, match="inside model_fn"):
        estimator.get_or_create_global_step()


def test_tfs_batch_normalization_filter_leaves_flax_batch_norms_out(tmp_path):
    """Issue 41 item 9: ``'batch_normalization' not in v.name`` (EfficientNet, ResNet) over a
    Flax ``BatchNorm_0`` and a user-named one, also inside a variable_scope and a get_variable."""
    kept: dict = {}

    def model_fn(features, labels, mode, params):
        x = nn.BatchNorm(use_running_average=False)(nn.Dense(8, name="hidden")(features["x"]))
        with estimator.variable_scope("Discriminator", reuse=estimator.AUTO_REUSE):
            x = nn.BatchNorm(use_running_average=False, name="d_bn1")(x)
        logits = x @ estimator.get_variable("out", [8, 3])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        tvars = estimator.trainable_variables()
        kept["decayed"] = [v.name for v in tvars if "batch_normalization" not in v.name]
        kept["gamma"] = [str(v.name) for v in tvars if "gamma" in v.name]
        kept["beta"] = [str(v.name) for v in tvars if "beta" in v.name]
        kept["re"] = [v.name for v in tvars if re.search("batch_normalization", v.name)]
        return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.1))

    est = h.make_estimator(tmp_path, model_fn, use_tpu=False)
    est.train(h.train_input_fn(X, Y), max_steps=1)
    assert kept["decayed"] == ["hidden/bias:0", "hidden/kernel:0", "out:0"]
    assert kept["gamma"] == ["BatchNorm_0/scale:0", "Discriminator/d_bn1/scale:0"]
    assert kept["beta"] == ["BatchNorm_0/bias:0", "Discriminator/d_bn1/bias:0"]
    assert kept["re"] == []  # only ``in`` sees TF's names; the text is the checkpoint's


def test_global_variables_and_collections_name_batch_norm_statistics_as_tf(tmp_path):
    """Issue 41 item 7: EfficientNet's ``get_ema_vars()`` reads ``tf.global_variables()``
    for ``moving_mean`` / ``moving_variance`` and ``tf.get_collection('moving_vars')``."""
    seen: dict = {}

    def model_fn(features, labels, mode, params):
        x = nn.BatchNorm(use_running_average=False)(nn.Dense(8, name="hidden")(features["x"]))
        with estimator.variable_scope("Discriminator"):
            x = nn.BatchNorm(use_running_average=False, name="d_bn1")(x)
        logits = nn.Dense(3, name="out")(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        every = estimator.global_variables()
        seen["global"] = [str(v.name) for v in every]
        seen["stats"] = [
            str(v.name) for v in every if "moving_mean" in v.name or "moving_variance" in v.name
        ]
        seen["moving_vars"] = [str(v.name) for v in estimator.get_collection("moving_vars")]
        seen["scoped"] = [str(v.name) for v in estimator.global_variables("Discriminator")]
        seen["trainable"] = [
            str(v.name) for v in estimator.get_collection(estimator.GraphKeys.TRAINABLE_VARIABLES)
        ]
        seen["update_ops"] = estimator.get_collection(estimator.GraphKeys.UPDATE_OPS)
        return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.1))

    est = h.make_estimator(tmp_path, model_fn, use_tpu=False)
    est.train(h.train_input_fn(X, Y), max_steps=1)
    stats = [
        "batch_stats/BatchNorm_0/mean:0",
        "batch_stats/BatchNorm_0/var:0",
        "batch_stats/Discriminator/d_bn1/mean:0",
        "batch_stats/Discriminator/d_bn1/var:0",
    ]
    assert seen["global"] == seen["trainable"] + stats
    assert seen["stats"] == seen["moving_vars"] == stats
    assert {f"{n[:-2]}" for n in seen["global"]} == set(est.get_variable_names()) - {"global_step"}
    assert seen["scoped"] == [
        "Discriminator/d_bn1/bias:0",
        "Discriminator/d_bn1/scale:0",
        *stats[2:],
    ]
    assert seen["update_ops"] == []


def test_an_unknown_collection_is_named():
    with pytest.raises(ValueError, match="get_collection\\('losses'\\)"):
        estimator.get_collection("losses")
    with pytest.raises(RuntimeError, match="inside model_fn"):
        estimator.global_variables()
