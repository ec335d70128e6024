"""TF's variable scopes in model_fn (issue 41): ``variable_scope(name, reuse=AUTO_REUSE)``
shares a network built twice (DCGAN's discriminator), ``get_variable`` makes a variable at
model_fn level (BERT's classifier head), and a Flax name clash says how to share."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
from estimator.engine.initializers import as_initializer
from tests import helpers as h

B = 16


class _Root(nn.Module):
    """A compact module calling ``fn`` as the estimator's root calls model_fn."""

    fn: object

    @nn.compact
    def __call__(self, *args):
        return self.fn(*args)


def _init_apply(fn, *args):
    root = _Root(fn)
    variables = root.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, *args)
    out, _ = root.apply(variables, *args, rngs={"dropout": jax.random.key(2)}, mutable=True)
    return variables, out


def discriminator(x, reuse=estimator.AUTO_REUSE, scope="Discriminator"):
    """DCGAN's discriminator, in form: named layers under a reused variable scope."""
    with estimator.variable_scope(scope, reuse=reuse):
        x = nn.leaky_relu(nn.Dense(8, name="d_h0")(x))
        x = nn.BatchNorm(use_running_average=False, name="d_bn1")(x)
        return nn.Dense(1, name="d_fc")(nn.Dense(4)(x))  # an unnamed one is shared too


def test_a_scope_entered_again_with_reuse_shares_every_variable():
    x = np.random.RandomState(0).randn(4, 5).astype(np.float32)

    def two_calls(real, fake):
        return discriminator(real), discriminator(fake), discriminator(real)

    variables, (d_real, d_fake, d_again) = _init_apply(two_calls, x, 2 * x)
    params = variables["params"]
    assert list(params) == ["Discriminator"]
    assert sorted(params["Discriminator"]) == ["Dense_0", "d_bn1", "d_fc", "d_h0"]
    np.testing.assert_array_equal(d_real, d_again)  # the same weights on the same input
    assert not np.allclose(d_real, d_fake)


@pytest.mark.parametrize("reuse", [None, False])
def test_a_second_entry_without_reuse_names_the_fix(reuse):
    x = jnp.ones((2, 5))
    with pytest.raises(ValueError, match=r"second time without reuse.*reuse=estimator.AUTO_REUSE"):
        _init_apply(lambda x: (discriminator(x, reuse), discriminator(x, reuse)), x)


def test_nested_and_default_named_scopes_and_the_yielded_name():
    names = []

    def fn(x):
        with estimator.variable_scope("outer"):
            with estimator.variable_scope("inner") as scope:
                names.append(scope.name)
                y = nn.Dense(2, name="d")(x)
        for _ in range(2):  # TF's default_name: made unique, never reused
            with estimator.variable_scope(None, default_name="bert") as scope:
                names.append(scope.name)
                y = y + nn.Dense(2, name="d")(x)
        return y

    variables, _ = _init_apply(fn, jnp.ones((2, 3)))
    assert sorted(variables["params"]) == ["bert", "bert_1", "outer"]
    assert sorted(variables["params"]["outer"]["inner"]["d"]) == ["bias", "kernel"]
    assert names[:3] == ["outer/inner", "bert", "bert_1"]


def test_scope_errors_outside_model_fn_and_on_a_module_name():
    with pytest.raises(RuntimeError, match="only be called inside model_fn"):
        with estimator.variable_scope("D"):
            pass

    def clash(x):
        nn.Dense(2, name="D")(x)
        with estimator.variable_scope("D", reuse=True):
            return nn.Dense(2)(x)

    with pytest.raises(ValueError, match="already the name of a module"):
        _init_apply(clash, jnp.ones((2, 3)))


def test_get_variable_creates_reuses_and_scopes_variables():
    def head(x):
        w = estimator.get_variable(
            "output_weights",
            [3, 5],
            initializer=jax.nn.initializers.truncated_normal(stddev=0.02),
        )
        b = estimator.get_variable("output_bias", [3], initializer=jax.nn.initializers.zeros)
        again = estimator.get_variable("output_weights", [3, 5])  # TF's reuse: the same one
        with estimator.variable_scope("cls", reuse=estimator.AUTO_REUSE):
            c = estimator.get_variable("c", initializer=np.full((3,), 2.0, np.float32))
        with estimator.variable_scope("cls", reuse=estimator.AUTO_REUSE):
            c2 = estimator.get_variable("c", [3])
        return x @ w.T + b + c, jnp.array_equal(w, again) & jnp.array_equal(c, c2)

    variables, (logits, same) = _init_apply(head, jnp.ones((2, 5)))
    params = variables["params"]
    assert sorted(params) == ["cls", "output_bias", "output_weights"]
    assert params["output_weights"].shape == (3, 5) and bool(same)
    np.testing.assert_array_equal(params["output_bias"], np.zeros(3))
    np.testing.assert_array_equal(params["cls"]["c"], np.full(3, 2.0))
    assert logits.shape == (2, 3)


def test_get_variable_errors():
    with pytest.raises(RuntimeError, match="only be called inside model_fn"):
        estimator.get_variable("w", [2])
    cases = [
        (lambda: estimator.get_variable("w"), "needs a shape"),
        (lambda: estimator.get_variable("w", [2], trainable=False), "trainable=False"),
        (lambda: estimator.get_variable("a/w", [2]), "without '/'"),
        (
            lambda: (estimator.get_variable("w", [2]), estimator.get_variable("w", [3])),
            r"shape \(3,\), but .* has shape \(2,\)",
        ),
        (
            lambda: (nn.Dense(2, name="w")(jnp.ones((1, 2))), estimator.get_variable("w", [2])),
            "already a module's name",
        ),
    ]
    for fn, message in cases:
        with pytest.raises(ValueError, match=message):
            _init_apply(lambda fn=fn: fn())


def test_tf_initializers_map_to_the_same_distributions():
    tf = pytest.importorskip("tensorflow")
    key, shape = jax.random.key(0), (200, 300)

    def draw(init):
        fn, _ = as_initializer(init, None)
        return np.asarray(fn(key, shape, jnp.float32))

    tn = draw(tf.compat.v1.truncated_normal_initializer(stddev=0.02))
    assert np.abs(tn).max() <= 0.04 + 1e-6  # cut at two (untruncated) standard deviations
    np.testing.assert_allclose(tn.std(), 0.02 * 0.8796, rtol=0.02)
    np.testing.assert_array_equal(draw(tf.compat.v1.zeros_initializer()), 0.0)
    np.testing.assert_array_equal(draw(tf.compat.v1.constant_initializer(3.0)), 3.0)
    uni = draw(tf.compat.v1.random_uniform_initializer(-1.0, 2.0))
    assert uni.min() >= -1.0 and uni.max() < 2.0 and abs(uni.mean() - 0.5) < 0.02
    glorot = draw(tf.compat.v1.glorot_uniform_initializer())
    limit = np.sqrt(6.0 / sum(shape))
    assert np.abs(glorot).max() <= limit and glorot.max() > 0.95 * limit
    vs = draw(tf.compat.v1.variance_scaling_initializer(2.0, "fan_in", "normal"))
    np.testing.assert_allclose(vs.std(), np.sqrt(2.0 / shape[0]), rtol=0.03)
    with pytest.raises(TypeError, match="no JAX counterpart"):
        as_initializer(tf.compat.v1.initializers.identity(), None)
    default = draw(None)  # TF's default for get_variable: Glorot uniform
    assert np.abs(default).max() <= limit


def _gan_model_fn(features, labels, mode, params):
    """DCGAN's model_fn in form: a generator, the discriminator on real and generated data
    (batch norm in training mode in every mode), one variable made at model_fn level."""
    del labels
    noise, real = features["random_noise"], features.get("real_images")
    with estimator.variable_scope("Generator", reuse=estimator.AUTO_REUSE):
        fake = jnp.tanh(nn.Dense(5, name="g_fc")(noise))
    if mode == estimator.ModeKeys.PREDICT:
        return estimator.TPUEstimatorSpec(mode, predictions={"generated_images": fake})
    temperature = estimator.get_variable("temperature", [], initializer=1.0)
    d_real = discriminator(real) * temperature
    d_fake = discriminator(fake) * temperature
    loss = jnp.mean(optax.sigmoid_binary_cross_entropy(d_real, 1.0)) + jnp.mean(
        optax.sigmoid_binary_cross_entropy(d_fake, 0.0)
    )
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.adam(1e-3))


def test_the_dcgan_shape_trains_evaluates_and_predicts(tmp_path):
    x, _ = h.make_data(n=4 * B, d=5)
    noise = np.random.RandomState(1).randn(4 * B, 3).astype(np.float32)

    def train_input_fn(params):
        b = params["batch_size"]
        return {"real_images": x[:b], "random_noise": noise[:b]}, None  # one batch

    est = h.make_estimator(tmp_path, _gan_model_fn, ipl=2)
    est.train(train_input_fn, max_steps=2)
    names = est.get_variable_names()
    assert "Discriminator/d_h0/kernel" in names and "temperature" in names
    assert not [n for n in names if "Discriminator_" in n or "Generator_" in n]
    assert "batch_stats/Discriminator/d_bn1/mean" in names
    assert np.isfinite(est.evaluate(train_input_fn)["loss"])
    preds = list(
        est.predict(lambda params: ({"random_noise": noise[: params["batch_size"]]}, None))
    )
    assert len(preds) == B and preds[0]["generated_images"].shape == (5,)


def test_two_modules_of_one_name_in_model_fn_name_the_way_to_share(tmp_path):
    def model_fn(features, labels, mode, params):
        d_real = nn.Dense(1, name="Discriminator")(features)
        d_fake = nn.Dense(1, name="Discriminator")(features * 2)
        loss = jnp.mean(d_real - d_fake)
        return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.1))

    x, y = h.make_data(n=B)
    est = h.make_estimator(tmp_path, model_fn, ipl=1)
    with pytest.raises(ValueError, match=r"variable_scope\('Discriminator', reuse=estimator"):
        est.train(h.train_input_fn(x, y, features_dict=False), max_steps=1)
