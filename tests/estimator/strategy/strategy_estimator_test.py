"""A custom training loop with TPUStrategy.run trains exactly like TPUEstimator."""

import flax.linen as nn
import jax
import numpy as np
import optax

import estimator
from tests import helpers as h


class _Mlp(nn.Module):  # the same layers and names as tests.helpers.model_fn builds
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="out")(nn.relu(nn.Dense(16, name="hidden")(x)))


def test_custom_loop_matches_estimator(tmp_path):
    x, y = h.make_data()
    batch = 16
    est = estimator.TPUEstimator(
        h.model_fn, config=h.config(tmp_path, iterations_per_loop=2), train_batch_size=batch
    )
    input_fn = h.train_input_fn(x, y)
    est.train(input_fn, max_steps=2)
    start = h.params_of(est)
    est.train(input_fn, max_steps=8)  # continues the input stream at batch 2
    expected = h.params_of(est)

    strategy = estimator.TPUStrategy()
    model, tx = _Mlp(), optax.sgd(0.1)
    params = {
        layer: {"kernel": start[f"{layer}/kernel"], "bias": start[f"{layer}/bias"]}
        for layer in ("hidden", "out")
    }
    opt_state = tx.init(params)
    stream = h.train_input_fn(x, y, features_dict=False)({"batch_size": batch})
    batches = [next(stream) for _ in range(8)][2:]

    def step_fn(params, opt_state, inputs):
        features, labels = inputs

        def loss_fn(p):
            logits = model.apply({"params": p}, features)
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return per_example.sum() / batch

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = estimator.get_replica_context().all_reduce(estimator.ReduceOp.SUM, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for inputs in strategy.experimental_distribute_dataset(batches):
        params, opt_state, _ = strategy.run(step_fn, args=(params, opt_state, inputs))
    params = strategy.experimental_local_results(params)[0]
    assert strategy.num_replicas_in_sync == est.num_replicas == 8
    for layer in ("hidden", "out"):
        for leaf in ("kernel", "bias"):
            np.testing.assert_allclose(
                np.asarray(params[layer][leaf]), expected[f"{layer}/{leaf}"], rtol=1e-5, atol=1e-6
            )


def test_replica_context_inside_model_fn(tmp_path):
    x, y = h.make_data()
    seen = {}

    def model_fn(features, labels, mode, params):
        ctx = estimator.get_replica_context()
        seen["replicas"] = ctx.num_replicas_in_sync
        spec = h.model_fn(features, labels, mode, params)
        # The all-reduced mean of the per-replica loss equals the estimator's reported loss.
        spec.loss = ctx.all_reduce(estimator.ReduceOp.MEAN, spec.loss)
        return spec

    est = estimator.TPUEstimator(
        model_fn, config=h.config(tmp_path), train_batch_size=16, eval_batch_size=16
    )
    est.train(h.train_input_fn(x, y), max_steps=2)
    assert seen["replicas"] == 8
