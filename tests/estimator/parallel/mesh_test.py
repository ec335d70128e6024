"""make_mesh's errors say how to get more devices where they can be simulated (CPU)."""

from __future__ import annotations

import jax
import pytest

from estimator.parallel.mesh import make_mesh

FLAG = "XLA_FLAGS=--xla_force_host_platform_device_count=8"


def test_a_count_that_does_not_fit_the_cpu_devices_names_the_flag():
    one = jax.devices()[:1]
    with pytest.raises(ValueError, match="does not divide the 1 devices") as e:
        make_mesh(num_cores_per_replica=2, devices=one)
    assert FLAG in str(e.value) and "before JAX is imported" in str(e.value)
    with pytest.raises(ValueError, match="needs 4 devices, but 1 are available") as e:
        make_mesh(num_replicas=4, devices=one)
    assert FLAG in str(e.value)


def test_a_mesh_that_fits_is_built():
    mesh = make_mesh(num_cores_per_replica=2)
    assert dict(mesh.shape) == {"data": jax.device_count() // 2, "model": 2}
