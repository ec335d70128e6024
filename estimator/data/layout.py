"""How one mode's global batch maps onto processes, replicas and input_fn pulls.

Every branch on ``InputPipelineConfig`` lives here:

* ``PER_HOST_V1``: input_fn is called once per process and yields this process's rows;
* ``PER_HOST_V2`` (and ``PER_SHARD_V1``): the iterator is pulled once per local replica per
  step, each pull one replica's rows;
* ``BROADCAST``: one pull is the whole global batch, and every replica gets all of it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ..core.config import InputPipelineConfig
from ..core.errors import EstimatorTypeError, EstimatorValueError

_BATCH_FIELDS = {
    "train": "train_batch_size",
    "eval": "eval_batch_size",
    "infer": "predict_batch_size",
}


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """The batch arithmetic of one mode.

    Attributes:
      mode: the ``ModeKeys`` value.
      global_rows: the global batch size; None with ``use_tpu=False`` when it was not given
        (then the first batch decides).
      replicas: replicas in the mesh.
      local_replicas: the replicas this process feeds.
      processes: processes in the job.
      pipeline: the ``InputPipelineConfig``.
      required: whether the batch size must be given (``use_tpu=True``).

    Example:
      >>> layout = BatchLayout("train", 128, replicas=8, local_replicas=8, processes=1,
      ...                      pipeline=InputPipelineConfig.PER_HOST_V2)
      >>> layout.input_batch_size, layout.pulls_per_step, layout.rows_per_pull
      (16, 8, 16)
    """

    mode: str
    global_rows: int | None
    replicas: int
    local_replicas: int
    processes: int
    pipeline: int
    required: bool = False

    @property
    def field(self) -> str:
        """The estimator argument that sets this batch size (for messages)."""
        return _BATCH_FIELDS[self.mode]

    @property
    def broadcast(self) -> bool:
        return self.pipeline == InputPipelineConfig.BROADCAST

    @property
    def per_replica_pulls(self) -> bool:
        return self.pipeline in (InputPipelineConfig.PER_HOST_V2, InputPipelineConfig.PER_SHARD_V1)

    @property
    def input_batch_size(self) -> int | None:
        """``params["batch_size"]`` for input_fn: per replica, global, or per process."""
        if self.global_rows is None:
            return None
        if self.per_replica_pulls:
            return self.global_rows // self.replicas
        if self.broadcast:
            return self.global_rows
        return self.global_rows // self.processes

    @property
    def process_rows(self) -> int | None:
        """Rows this process's input contributes to one step (before broadcast copies)."""
        if self.global_rows is None or self.broadcast:
            return self.global_rows
        return self.global_rows * self.local_replicas // self.replicas

    @property
    def pulls_per_step(self) -> int:
        return self.local_replicas if self.per_replica_pulls else 1

    @property
    def rows_per_pull(self) -> int | None:
        rows = self.process_rows
        if rows is None or not self.per_replica_pulls:
            return rows
        return rows // self.local_replicas

    @property
    def input_processes(self) -> int:
        """Processes whose inputs together make one global batch (1 in BROADCAST)."""
        return 1 if self.broadcast else self.processes

    @property
    def copies(self) -> int:
        """How many replicas see each input row (all of them in BROADCAST)."""
        return self.local_replicas if self.broadcast else 1

    def check_given(self) -> None:
        """Raises EstimatorValueError when the batch size is required but was not given."""
        if self.required and self.global_rows is None:
            raise EstimatorValueError(
                f"{self.field} must be set to run {self.mode} with use_tpu=True"
            )

    def loop_policy(self, *, unrolled: bool) -> LoopPolicy:
        """This mode's ``LoopPolicy``; ``unrolled``: whether its compiled loop is unrolled
        (then merging loops would grow the program with them)."""
        return LoopPolicy(
            self.mode, self.processes, merge_loops=self.mode == "eval" and not unrolled
        )

    def count_once(self, host_mask: np.ndarray) -> np.ndarray:
        """The ``[steps, rows]`` mask with BROADCAST's copies dropped (replica 0's kept)."""
        if not self.broadcast:
            return host_mask
        keep = np.zeros_like(host_mask)
        per_replica = host_mask.shape[1] // self.replicas
        keep[:, :per_replica] = host_mask[:, :per_replica]
        return keep


@dataclasses.dataclass(frozen=True)
class LoopPolicy:
    """How one mode's input becomes compiled calls; it follows from the mode, the number of
    processes and whether the mode's loop is unrolled.

    * ``pads``: evaluation and prediction pad a short batch and run every example; the loops
      go on while any process has rows. Training keeps whole batches and ends where the
      shortest process's input does.
    * ``exact_tail``: training runs a loop's tail as one call of exactly its steps;
      evaluation and prediction run it as calls of power-of-two lengths (few programs).
    * ``merge_loops``: evaluation with rolled loops runs several whole loops in one call.
    * ``split_short``: in one process, a call the input cut short runs as whole loops and
      then powers of two of its real steps.
    * ``pad_short``: evaluation or prediction over several processes, whose inputs may end
      at different steps: a call cut short is padded to its planned length instead.

    Example:
      >>> policy = LoopPolicy("eval", processes=1, merge_loops=True)
      >>> policy.pads, policy.exact_tail, policy.split_short, policy.pad_short
      (True, False, True, False)
    """

    mode: str
    processes: int = 1
    merge_loops: bool = False

    @property
    def pads(self) -> bool:
        return self.mode != "train"

    @property
    def exact_tail(self) -> bool:
        return not self.pads

    @property
    def split_short(self) -> bool:
        return self.processes == 1

    @property
    def pad_short(self) -> bool:
        return self.pads and self.processes > 1


def check_batch_size(
    field: str, value: object, *, required: bool, replicas: int, pipeline: int
) -> int | None:
    """Validates one of the estimator's ``*_batch_size`` arguments.

    Raises:
      EstimatorValueError: missing where required, not positive, or not divisible by the
        number of replicas (except in BROADCAST).
      EstimatorTypeError: not an int.
    """
    if value is None:
        if required:
            raise EstimatorValueError(f"{field} must be set when use_tpu=True")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise EstimatorTypeError(f"{field} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise EstimatorValueError(f"{field} must be positive, got {value}")
    if pipeline != InputPipelineConfig.BROADCAST and value % replicas:
        raise EstimatorValueError(
            f"{field}={value} is not divisible by the number of replicas ({replicas})"
        )
    return int(value)


def batch_layouts(
    sizes: dict[str, object], *, replicas: int, local_replicas: int, pipeline: int, use_tpu: bool
) -> dict[str, BatchLayout]:
    """The layout of each mode from the estimator's ``*_batch_size`` arguments (checked:
    ``use_tpu=True`` requires the training batch size at construction, the others when used).
    """
    return {
        mode: BatchLayout(
            mode,
            check_batch_size(
                _BATCH_FIELDS[mode],
                value,
                required=use_tpu and mode == "train",
                replicas=replicas,
                pipeline=pipeline,
            ),
            replicas=replicas,
            local_replicas=local_replicas,
            processes=jax.process_count(),
            pipeline=pipeline,
            required=use_tpu,
        )
        for mode, value in sizes.items()
    }
