"""num_cores_per_replica and input_partition_dims in the estimator: same results, less memory."""

import flax.linen as nn
import jax.numpy as jnp
import optax
import pytest

import estimator
from tests import helpers as h


def _sharded_model_fn(features, labels, mode, params):
    """The helpers MLP with its hidden layer split over the "model" axis."""
    init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    x = features["x"]
    if x.ndim == 4:  # images: flatten after the (possibly spatially split) input
        x = x.reshape(x.shape[0], -1)
    hidden = nn.Dense(16, name="hidden", kernel_init=init)(x)
    logits = nn.Dense(3, name="out")(nn.relu(hidden))
    mask = estimator.padding_mask()
    loss = (optax.softmax_cross_entropy_with_integer_labels(logits, labels) * mask).sum() / (
        jnp.maximum(mask.sum(), 1.0)
    )
    return estimator.TPUEstimatorSpec(
        mode, loss=loss, train_op=optax.sgd(0.1), eval_metrics=(h.metric_fn, [labels, logits])
    )


def _train(tmp_path, *, cores, images=False, input_partition_dims=None):
    x, y = h.make_data(d=16)
    if images:
        x = x.reshape(-1, 4, 4, 1)
    tpu = {"num_cores_per_replica": cores, "input_partition_dims": input_partition_dims}
    est = estimator.TPUEstimator(
        _sharded_model_fn,
        config=h.config(tmp_path, iterations_per_loop=2, tpu=tpu),
        train_batch_size=16,
        eval_batch_size=16,
    )
    est.train(h.train_input_fn(x, y), max_steps=6)
    return est, est.evaluate(h.eval_input_fn(x, y))


def test_two_cores_per_replica_matches_data_parallel(tmp_path):
    dp, dp_eval = _train(tmp_path / "dp", cores=None)
    mp, mp_eval = _train(tmp_path / "mp", cores=2)
    assert dp.num_replicas == 8 and mp.num_replicas == 4
    assert dict(mp.mesh.shape) == {"data": 4, "model": 2}
    h.assert_params_close(h.params_of(dp), h.params_of(mp), rtol=1e-4, atol=1e-5)
    assert mp_eval["loss"] == pytest.approx(dp_eval["loss"], rel=1e-4)
    kernel = mp._job.store.last.state.params["hidden"]["kernel"]  # the in-memory state
    assert kernel.shape == (16, 16)
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, 8)}
    full = dp._job.store.last.state.params["hidden"]["kernel"]
    assert {s.data.shape for s in full.addressable_shards} == {(16, 16)}


def test_input_partition_dims_splits_images_spatially(tmp_path):
    plain, plain_eval = _train(tmp_path / "plain", cores=2, images=True)
    split, split_eval = _train(
        tmp_path / "split", cores=2, images=True, input_partition_dims=[[1, 2, 1, 1], None]
    )
    h.assert_params_close(h.params_of(plain), h.params_of(split), rtol=1e-4, atol=1e-5)
    assert split_eval["accuracy"] == plain_eval["accuracy"]


def test_input_partition_dims_must_fit_the_cores(tmp_path):
    with pytest.raises(ValueError, match="num_cores_per_replica"):
        _train(tmp_path, cores=2, images=True, input_partition_dims=[[1, 4, 1, 1], None])
