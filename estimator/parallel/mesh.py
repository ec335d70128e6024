"""The device mesh every compiled loop runs on.

Devices form a 2-D mesh ``("data", "model")`` of shape ``(replicas, cores_per_replica)``.
Loops are manual over ``"data"`` (one model_fn call per replica) and leave ``"model"`` to the
compiler. Both axes are ``AxisType.Auto`` so plain numpy input and bare ``PartitionSpec``
constraints work (with ``AxisType.Explicit`` every input would need an explicit sharding).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ..core.errors import EstimatorValueError

DATA = "data"
MODEL = "model"


def make_mesh(
    *,
    num_cores_per_replica: int | None = None,
    num_replicas: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds the ``("data", "model")`` mesh over ``devices`` (default: all devices).

    Args:
      num_cores_per_replica: devices per replica along ``"model"`` (default 1).
      num_replicas: replicas along ``"data"`` (default: all devices / cores per replica).
      devices: the devices to use, in order.

    Raises:
      ValueError: when the counts do not fit the devices, naming the argument.
    """
    devices = list(jax.devices() if devices is None else devices)
    cores = int(num_cores_per_replica or 1)
    if cores < 1:
        raise EstimatorValueError(
            f"num_cores_per_replica must be >= 1, got {num_cores_per_replica}"
        )
    if len(devices) % cores:
        raise EstimatorValueError(
            f"num_cores_per_replica={cores} does not divide the {len(devices)} devices"
            + _more_devices_hint(devices)
        )
    replicas = len(devices) // cores if num_replicas is None else int(num_replicas)
    if replicas < 1 or replicas * cores > len(devices):
        raise EstimatorValueError(
            f"num_replicas={num_replicas} x num_cores_per_replica={cores} needs "
            f"{replicas * cores} devices, but {len(devices)} are available"
            + _more_devices_hint(devices)
        )
    grid = np.array(devices[: replicas * cores], dtype=object).reshape(replicas, cores)
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def _more_devices_hint(devices: list) -> str:
    """How to get more devices where they can be simulated (CPU), for a count error."""
    if not devices or devices[0].platform != "cpu":
        return ""
    return (
        "; on a CPU-only machine, simulate more devices by starting Python with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before JAX is imported)"
    )


def single_device_mesh(device: jax.Device | None = None) -> Mesh:
    """A 1x1 mesh on one device: the ``use_tpu=False`` path runs the same code on it."""
    return make_mesh(devices=[device or jax.devices()[0]])


def num_replicas(mesh: Mesh) -> int:
    return mesh.shape[DATA]
