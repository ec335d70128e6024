"""InputContext: what an input pipeline needs to know about its place in the job."""

from __future__ import annotations

import dataclasses

from .errors import EstimatorValueError


@dataclasses.dataclass(frozen=True)
class InputContext:
    """Describes one input pipeline among several, as ``tf.distribute.InputContext`` did.

    Example:
      >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
      >>> ctx.get_per_replica_batch_size(64)
      8
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The global batch split evenly over replicas; uneven is a ValueError."""
        if global_batch_size % self.num_replicas_in_sync:
            raise EstimatorValueError(
                f"global_batch_size={global_batch_size} is not divisible by "
                f"num_replicas_in_sync={self.num_replicas_in_sync}"
            )
        return global_batch_size // self.num_replicas_in_sync
