"""Fetching device outputs to the host: the same values as jax.device_get, for every layout."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from estimator.parallel import multihost


@pytest.mark.parametrize(
    "spec",
    [
        P(None, "data"),
        P("data"),
        P("data", "model"),
        P(),
        P(None, None, "model"),
        P(("data", "model")),
    ],
)
def test_to_host_equals_device_get_for_every_layout(spec):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x = np.arange(8 * 8 * 4, dtype=np.float32).reshape(8, 8, 4)
    y = jax.device_put(x, NamedSharding(mesh, spec))
    tree = {"a": y, "b": None, "c": 3, "d": np.ones(2, np.int32)}
    got, want = multihost.to_host(tree), jax.device_get(tree)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)
        assert np.asarray(g).dtype == np.asarray(w).dtype
    local = multihost.local_to_host(tree, mesh)
    np.testing.assert_array_equal(local["a"], x)
    if got["a"].flags.writeable:  # a copy: writing to it leaves the device array alone
        got["a"][0, 0, 0] = -1
        assert np.asarray(y)[0, 0, 0] == 0
