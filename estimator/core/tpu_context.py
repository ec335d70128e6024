"""``params["context"]``: where model_fn's replica or input_fn's pipeline runs (TF's TPUContext).

model_fn sees the replica layout; input_fn sees it too, plus which host calls it and how its
batches are deployed (``current_input_fn_deployment()``), as TF's ``TPUContext`` gave them.

Example:
  >>> def input_fn(params):
  ...     ctx = params["context"]
  ...     host_device, index, count, replicas = ctx.current_input_fn_deployment()
  ...     shard = dataset.shard(count, index)            # this host's share of the data
"""

from __future__ import annotations

import dataclasses

from .errors import EstimatorRuntimeError


@dataclasses.dataclass(frozen=True)
class TPUContext:
    """TF's ``TPUContext``.

    Attributes:
      mode: the ``ModeKeys`` value of the call.
      num_replicas: replicas in the job.
      num_hosts: processes (hosts) in the job.
      num_cores_per_replica: devices per replica (model parallelism).
      current_host: this host's index (input_fn only; None in model_fn).
      input_deployment: ``(host_device, invocation_index, total_invocations, replicas_fed)``
        of this input_fn call (input_fn only).
    """

    mode: str
    num_replicas: int
    num_hosts: int
    num_cores_per_replica: int = 1
    current_host: int | None = None
    input_deployment: tuple | None = None

    @property
    def num_of_replicas_per_host(self) -> int:
        """Replicas each host feeds."""
        return max(self.num_replicas // max(self.num_hosts, 1), 1)

    @property
    def num_of_cores_per_host(self) -> int:
        return self.num_of_replicas_per_host * self.num_cores_per_replica

    def current_input_fn_deployment(self) -> tuple[str, int, int, int]:
        """``(host_device, invocation_index, total_invocations, replicas_fed)`` of this
        input_fn call: input_fn is called once per host, and each call feeds that host's
        replicas (every pipeline mode; TF's per-core PER_SHARD_V1 is treated as PER_HOST_V2).

        Raises:
          RuntimeError: outside input_fn (TF sets it only in input_fn's params).
        """
        if self.input_deployment is None:
            raise EstimatorRuntimeError(
                "current_input_fn_deployment() is only available in input_fn's params['context']"
            )
        return self.input_deployment


def input_fn_context(
    mode: str, *, num_replicas: int, local_replicas: int, cores_per_replica: int = 1
) -> TPUContext:
    """input_fn's ``params["context"]`` for this process."""
    import jax

    host = jax.process_index()
    device = f"/job:worker/replica:0/task:{host}/device:CPU:0"
    return TPUContext(
        mode=mode,
        num_replicas=num_replicas,
        num_hosts=jax.process_count(),
        num_cores_per_replica=cores_per_replica,
        current_host=host,
        input_deployment=(device, host, jax.process_count(), local_replicas),
    )


__all__ = ["TPUContext", "input_fn_context"]
