"""Tests for estimator.partitioning: partition dims, Flax partitioning metadata, placement."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from estimator.parallel import partitioning
from estimator.parallel.mesh import DATA, MODEL, make_mesh

_SPEC_CASES = [
    # (partition_dimensions, keyword args, expected spec)
    (None, {}, P()),
    (None, {"batch_axis": DATA}, P(DATA)),
    ([1, 1], {"num_cores_per_replica": 1}, P(None, None)),
    ([1, 2], {"num_cores_per_replica": 2}, P(None, MODEL)),
    ([1, 4, 1, 1], {"num_cores_per_replica": 4}, P(None, MODEL, None, None)),
    ([2, 1], {}, P(MODEL, None)),
    ([1, 2, 1], {"batch_axis": DATA}, P(DATA, MODEL, None)),
    ([2, 1], {"batch_axis": DATA}, P((DATA, MODEL), None)),
]


@pytest.mark.parametrize(("dims", "kwargs", "expected"), _SPEC_CASES)
def test_partition_spec_from_dims(dims, kwargs, expected):
    assert partitioning.partition_spec_from_dims(dims, **kwargs) == expected


@pytest.mark.parametrize(
    ("dims", "cores", "message"),
    [
        ([1, 0], None, "positive"),
        ([2, 2], 4, "at most one dimension"),
        ([1, 2], 4, "product"),
        ([1, 1], 2, "product"),
    ],
)
def test_partition_spec_from_dims_errors(dims, cores, message):
    with pytest.raises(ValueError, match=message):
        partitioning.partition_spec_from_dims(dims, num_cores_per_replica=cores)


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(8, kernel_init=nn.with_partitioning(init, (None, "model")))(x)
        h = nn.Dense(6, kernel_init=nn.with_logical_partitioning(init, ("hidden", None)))(h)
        return nn.Dense(2)(h)


def _variables():
    return _Mlp().init(jax.random.key(0), jnp.ones((2, 4)))


def test_param_specs_reads_partitioning_metadata():
    specs = partitioning.param_specs(_variables())["params"]
    assert specs["Dense_0"]["kernel"] == P(None, MODEL)
    assert specs["Dense_0"]["bias"] == P()
    assert specs["Dense_1"]["kernel"] == P(None, None)  # "hidden" has no rule
    assert specs["Dense_2"]["kernel"] == P()


def test_param_specs_rules_map_logical_names():
    specs = partitioning.param_specs(_variables(), rules=[("hidden", MODEL), ("model", None)])
    assert specs["params"]["Dense_0"]["kernel"] == P(None, None)
    assert specs["params"]["Dense_1"]["kernel"] == P(MODEL, None)


def test_param_specs_accept_abstract_variables():
    abstract = jax.eval_shape(_Mlp().init, jax.random.key(0), jnp.ones((2, 4)))
    assert partitioning.param_specs(abstract) == partitioning.param_specs(_variables())


def test_shard_variables_halves_the_per_device_shard():
    mesh = make_mesh(num_cores_per_replica=2)
    placed = partitioning.shard_variables(mesh, _variables())
    kernel = placed["params"]["Dense_0"]["kernel"]
    assert kernel.shape == (4, 8)
    assert {s.data.shape for s in kernel.addressable_shards} == {(4, 4)}
    bias = placed["params"]["Dense_0"]["bias"]
    assert {s.data.shape for s in bias.addressable_shards} == {(8,)}
    np.testing.assert_array_equal(
        kernel, partitioning.unbox(_variables())["params"]["Dense_0"]["kernel"]
    )


def test_unbox_strips_boxes():
    unboxed = partitioning.unbox(_variables())
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(unboxed))
    assert not any(
        isinstance(x, nn.Partitioned)
        for x in jax.tree.leaves(unboxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    )


@pytest.mark.parametrize(
    ("names", "shape", "message"),
    [
        ((None, "model"), (4, 3), "not divisible"),
        (("model",), (4, 4), "rank 2"),
        (("model", "model"), (4, 4), "more than one dimension"),
    ],
)
def test_param_shardings_errors_name_the_variable(names, shape, message):
    mesh = make_mesh(num_cores_per_replica=2)
    variables = {"layer": {"w": nn.Partitioned(jnp.zeros(shape), names=names)}}
    with pytest.raises(ValueError, match=message) as info:
        partitioning.param_shardings(mesh, variables)
    assert "['layer']['w']" in str(info.value)


def test_split_and_replicate_constraints_keep_values():
    mesh = make_mesh(num_cores_per_replica=2)
    x = jnp.arange(32.0).reshape(4, 8)
    split = partitioning.split_to_logical_devices(x, [1, 2], num_cores_per_replica=2, mesh=mesh)
    assert split.sharding.spec == P(None, MODEL)
    whole = partitioning.replicate_to_logical_devices(split, mesh=mesh)
    assert whole.sharding.spec == P()
    np.testing.assert_array_equal(whole, x)


@pytest.mark.parametrize(
    ("dims", "shape", "message"),
    [([2], (4, 8), "rank 2"), ([1, 2], (4, 7), "not divisible"), ([1, 4], (4, 8), "product")],
)
def test_split_to_logical_devices_errors(dims, shape, message):
    with pytest.raises(ValueError, match=message):
        partitioning.split_to_logical_devices(jnp.zeros(shape), dims, num_cores_per_replica=2)


@pytest.mark.parametrize("device_id", [-1, 2])
def test_assign_to_logical_device_checks_range(device_id):
    with pytest.raises(ValueError, match="out of range"):
        partitioning.assign_to_logical_device(jnp.zeros(3), device_id, num_cores_per_replica=2)
