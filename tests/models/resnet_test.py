"""ResNet: standard parameter counts, and cross-replica BatchNorm through the estimator."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import estimator
from models import resnet
from models.mlp import classifier_model_fn
from tests import helpers as h


def _num_params(module, shape):
    variables = jax.eval_shape(
        lambda: module.init(jax.random.key(0), jnp.zeros(shape), train=False)
    )
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(variables["params"]))


@pytest.mark.parametrize(
    "depth, expected",
    # torchvision's resnet18/resnet50 (BatchNorm scale and bias counted, running stats not).
    [(18, 11_689_512), (50, 25_557_032)],
)
def test_imagenet_parameter_counts_match_the_reference_architecture(depth, expected):
    assert _num_params(resnet.resnet(depth, num_classes=1000), (1, 224, 224, 3)) == expected


def test_unknown_depth_and_stem_name_the_value():
    with pytest.raises(ValueError, match="depth=20"):
        resnet.resnet(20)
    with pytest.raises(ValueError, match="stem='tiny'"):
        _num_params(resnet.resnet(18, stem="tiny"), (1, 32, 32, 3))


def _data(n=64, size=8, classes=4):
    rng = np.random.RandomState(0)
    x = rng.rand(n, size, size, 3).astype(np.float32)
    return x, rng.randint(0, classes, n).astype(np.int32)


def _input_fn(x, y):
    def input_fn(params):
        b = params["batch_size"]
        while True:
            for i in range(0, len(x) - b + 1, b):
                yield x[i : i + b], y[i : i + b]

    return input_fn


def _train(model_dir, *, use_tpu, cross_replica_bn):
    def model_fn(features, labels, mode, params):
        # Two stages of basic blocks: the module code of ResNet-18 in a small graph.
        module = resnet.ResNet(
            (1, 1), num_filters=4, stem="cifar", num_classes=4, cross_replica_bn=cross_replica_bn
        )
        return classifier_model_fn(module)(features, labels, mode, params)

    params = {"optimizer": "momentum", "learning_rate": 0.05, "write_summaries": False}
    est = estimator.TPUEstimator(
        model_fn,
        config=h.config(model_dir, iterations_per_loop=2, tpu={"unroll_loops": True}),
        params=params,
        use_tpu=use_tpu,
        train_batch_size=32,
    )
    est.train(_input_fn(*_data()), max_steps=2)
    return est


def _bn_apply(cross_replica_bn):
    module = resnet.ResNet(
        (1, 1), num_filters=4, stem="cifar", num_classes=4, cross_replica_bn=cross_replica_bn
    )

    def apply(variables, x):
        logits, new = module.apply(variables, x, train=True, mutable=["batch_stats"])
        return logits, new["batch_stats"]

    return module, apply


def test_cross_replica_batch_norm_uses_global_batch_statistics(fast_compile):
    x, _ = _data(n=32)
    module, global_apply = _bn_apply(False)
    variables = module.init(jax.random.key(0), x[:4], train=False)
    want_logits, want_stats = jax.jit(global_apply)(variables, x)  # one device, whole batch

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    _, cross = _bn_apply(True)
    logits, stats = jax.jit(
        jax.shard_map(cross, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P()))
    )(variables, x)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), stats, want_stats
    )

    # Per-replica statistics (4 rows each) normalise differently: the option matters.
    _, local = _bn_apply(False)
    local_logits, _ = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P("data")))
    )(variables, x)
    assert not np.allclose(local_logits, want_logits, atol=1e-3)


def test_per_replica_batch_norm_trains_on_8_replicas(tmp_path, fast_compile):
    est = _train(tmp_path, use_tpu=True, cross_replica_bn=False)
    assert est.get_variable_value("global_step") == 2
