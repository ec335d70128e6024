"""DeviceAssignment: which devices form each replica, as ``tf.tpu.experimental.DeviceAssignment``.

A device assignment is a ``("data", "model")`` mesh of shape
``(num_replicas, num_cores_per_replica)``: replica ``r`` runs on the devices of row ``r``, and
the compiler partitions a replica's computation over its row (model parallelism).

    da = DeviceAssignment.build(computation_shape=[1, 1, 1, 2])   # 2 cores per replica
    strategy = estimator.TPUStrategy(device_assignment=da)        # 8 devices: 4 replicas
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ..core.errors import EstimatorTypeError, EstimatorValueError
from ..parallel.mesh import DATA, MODEL, make_mesh


def _topology_devices(topology: Any) -> list[jax.Device]:
    """Devices of ``topology``: None (all), a sequence, or an object with ``devices``."""
    if topology is None:
        return list(jax.devices())
    devices = getattr(topology, "devices", topology)
    if callable(devices):
        devices = devices()
    try:
        flat = list(np.asarray(devices, dtype=object).ravel())
    except TypeError:
        flat = []
    if not flat or not all(isinstance(d, jax.Device) for d in flat):
        raise EstimatorTypeError(
            "topology must be None, a sequence of jax devices, or an object with a "
            f"`devices` attribute holding them; got {topology!r}"
        )
    return flat


def _cores_per_replica(computation_shape: int | Sequence[int] | None) -> int:
    """Cores per replica from a TF-style ``computation_shape`` ([1, 1, 1, k] -> k) or an int."""
    if computation_shape is None:
        return 1
    dims = [computation_shape] if np.ndim(computation_shape) == 0 else list(computation_shape)
    if not dims or any(int(d) != d or d < 1 for d in dims):
        raise EstimatorValueError(
            f"computation_shape must be a positive int or a sequence of them, got "
            f"{computation_shape!r}"
        )
    return math.prod(int(d) for d in dims)


@dataclasses.dataclass(frozen=True)
class DeviceAssignment:
    """Maps (replica, logical core) to a device; holds the mesh that realises it.

    Example:
      >>> da = DeviceAssignment.build(computation_shape=2, num_replicas=1)
      >>> da.num_replicas, da.num_cores_per_replica
      (1, 2)
      >>> da.tpu_device(replica=0, logical_core=1) == jax.devices()[1]
      True
    """

    mesh: Mesh

    @classmethod
    def build(
        cls,
        topology: Any = None,
        computation_shape: int | Sequence[int] | None = None,
        num_replicas: int | None = None,
    ) -> DeviceAssignment:
        """Lays replicas of ``computation_shape`` cores out over the devices of ``topology``.

        Args:
          topology: None for every device JAX sees (``jax.devices()``, all processes), a
            sequence of devices, or an object with a ``devices`` attribute.
          computation_shape: cores per replica, as an int or TF's shape (the product is
            used: ``[1, 1, 1, 2]`` is 2). Default 1.
          num_replicas: replicas to build; default as many as the devices hold.

        Returns:
          A DeviceAssignment whose replica ``r`` is row ``r`` of the mesh: devices
          ``r * cores .. (r + 1) * cores - 1`` in topology order.

        Raises:
          ValueError: the shape or replica count does not fit the devices.
          TypeError: ``topology`` holds no devices.
        """
        devices = _topology_devices(topology)
        cores = _cores_per_replica(computation_shape)
        mesh = make_mesh(num_cores_per_replica=cores, num_replicas=num_replicas, devices=devices)
        return cls(mesh)

    @classmethod
    def from_mesh(cls, mesh: Mesh) -> DeviceAssignment:
        """Wraps an existing ``("data", "model")`` mesh."""
        if tuple(mesh.axis_names) != (DATA, MODEL):
            raise EstimatorValueError(f"mesh axes must be {(DATA, MODEL)}, got {mesh.axis_names}")
        return cls(mesh)

    @property
    def num_replicas(self) -> int:
        """Number of replicas (the ``"data"`` axis size)."""
        return int(self.mesh.shape[DATA])

    @property
    def num_cores_per_replica(self) -> int:
        """Devices per replica (the ``"model"`` axis size)."""
        return int(self.mesh.shape[MODEL])

    @property
    def devices(self) -> np.ndarray:
        """The devices as an object array of shape ``(num_replicas, num_cores_per_replica)``."""
        return self.mesh.devices

    def tpu_device(self, replica: int = 0, logical_core: int = 0) -> jax.Device:
        """The device running ``logical_core`` of ``replica`` (TF's ``tpu_device``)."""
        if not 0 <= replica < self.num_replicas:
            raise EstimatorValueError(f"replica {replica} out of range [0, {self.num_replicas})")
        if not 0 <= logical_core < self.num_cores_per_replica:
            raise EstimatorValueError(
                f"logical_core {logical_core} out of range [0, {self.num_cores_per_replica})"
            )
        return self.mesh.devices[replica, logical_core]

    def lookup_replicas(self, task_id: int | None = None) -> list[int]:
        """Replica ids with a device on process ``task_id`` (default: this process)."""
        task = jax.process_index() if task_id is None else task_id
        return [
            r
            for r in range(self.num_replicas)
            if any(d.process_index == task for d in self.mesh.devices[r])
        ]
