"""Placing variables for evaluation: one shared host copy on CPU devices, values unchanged."""

import gc

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from estimator.engine.state import one_copy_on_cpu


def _buffers(x: jax.Array) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


@pytest.mark.parametrize("shape, dtype", [((64, 512), np.float32), ((3,), np.int8), ((0, 4), bool)])
def test_replicated_arrays_share_one_buffer_with_the_same_values(shape, dtype):
    mesh = jax.make_mesh((8,), ("data",))
    values = np.random.RandomState(0).rand(*shape) * 100
    x = jax.jit(lambda v: v, out_shardings=NamedSharding(mesh, P()))(values.astype(dtype))
    assert len(_buffers(x)) == 8 or x.size == 0  # what a program leaves: a copy per device
    y = one_copy_on_cpu({"w": x})["w"]
    if x.size:
        assert len(_buffers(y)) == 1
    assert y.sharding == x.sharding and y.dtype == x.dtype
    del x
    gc.collect()
    _ = [np.full(shape, 7, dtype) for _ in range(20)]  # reuse freed host memory
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a)(y)), values.astype(dtype))


def test_split_and_single_device_arrays_are_left_as_they_are():
    mesh = jax.make_mesh((8,), ("data",))
    split = jax.device_put(np.arange(16.0), NamedSharding(mesh, P("data")))
    single = jax.device_put(np.arange(4.0), jax.devices()[0])
    out = one_copy_on_cpu({"split": split, "single": single, "host": np.ones(2)})
    assert out["split"] is split and out["single"] is single
    assert isinstance(out["host"], np.ndarray)
