"""RunConfig, TPUConfig and InputPipelineConfig: how a job runs, validated on construction.

Example:
  >>> config = RunConfig(model_dir="/tmp/run", save_checkpoints_steps=100,
  ...                    tpu_config=TPUConfig(iterations_per_loop=50))
  >>> config.replace(keep_checkpoint_max=2).keep_checkpoint_max
  2
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
import threading
from typing import Any

from .errors import EstimatorTypeError, EstimatorValueError

log = logging.getLogger("estimator")
_TF_ONLY = ("master", "evaluation_master", "session_config")
_TPU_TF_ONLY = (
    "tpu_job_name",
    "initial_infeed_sleep_secs",
    "eval_training_input_configuration",
    "experimental_allow_per_host_v2_parallel_get_next",
    "experimental_feed_hook",
)
_QUIET = threading.local()


def _warn_tf_only(owner: str, config: Any, names: tuple, what: str) -> None:
    """One warning naming the TF-only arguments given (not for copies made by replace)."""
    ignored = [n for n in names if getattr(config, n) is not None]
    if ignored and not getattr(_QUIET, "on", False):
        log.warning("%s: %s ignored (%s have no meaning here)", owner, ", ".join(ignored), what)


class InputPipelineConfig(enum.IntEnum):
    """How input_fn is called and how its batches reach the replicas (TF's values)."""

    PER_SHARD_V1 = 1  # treated like PER_HOST_V2: one per-replica batch per replica
    PER_HOST_V1 = 2  # input_fn once per host with the per-host batch, split over local replicas
    PER_HOST_V2 = 3  # input_fn once per host with the per-replica batch, pulled once per replica
    BROADCAST = 4  # input_fn once with the global batch; every replica sees all of it


def _positive_int(name: str, value: Any, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise EstimatorTypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value <= 0:
        raise EstimatorValueError(f"{name} must be positive, got {value}")


@dataclasses.dataclass(frozen=True)
class TPUConfig:
    """Device-loop settings (TF's ``tf.estimator.tpu.TPUConfig``).

    Args:
      iterations_per_loop: steps per device loop: hooks, host_call delivery, logging and
        checkpoints happen once per loop. ``"auto"``: the first ``train`` call measures
        the host's work per loop and the step time on its first loops and picks the
        shortest loop whose overhead is at most 2% (``driver/auto_loop.py``), never past
        the checkpoint, summary and log cadences (``auto_loop_bound``: the value this
        field then holds, and what evaluation and prediction use).
      num_shards: replica count; when given it must equal the number the devices provide.
      num_cores_per_replica: devices per replica (model parallelism over the ``"model"`` axis).
      per_host_input_for_training: an ``InputPipelineConfig`` (``True`` means PER_HOST_V1,
        ``False`` PER_SHARD_V1).
      input_partition_dims: ``[feature_dims, label_dims]`` to split inputs spatially.
      host_call_every_n_steps: run ``host_call`` only on every n-th step.
      unroll_loops: unroll the per-loop ``lax.scan`` of every mode. XLA:CPU runs the
        gradient convolutions of a rolled training loop far slower (jax-ml/jax#12868);
        ``None`` unrolls the training loop on CPU when it is short (<= 10 steps) and keeps
        evaluation and prediction rolled (as fast there, and compiled once whatever the
        loop length, so evaluation can run several loops per call).
      shard_optimizer_state: keep 1/R of the optimizer state on each of the R replicas and
        reduce-scatter gradients instead of all-reducing them (ZeRO-1/2); parameters stay
        replicated between steps. See docs/sharding.md.
      shard_params: keep the parameters split over the replicas too, gathered for each step's
        forward and backward pass (ZeRO-3 / FSDP); implies ``shard_optimizer_state``.
      max_staged_input_bytes: the input bytes, per device, one compiled call may hold. A
        loop whose input is larger runs as several calls back to back (the same results),
        so device memory does not grow with ``iterations_per_loop``. ``None`` (default):
        256 MiB per device on TPU and GPU; on CPU, whose devices all live in host memory
        and where a transfer is a copy with no latency to hide, 2 MiB per process, shared
        by its CPU devices (8 MiB for evaluation, which fetches every call's outputs;
        docs/inputs.md).
      compute_dtype: ``None`` (float32), ``"bfloat16"`` or ``"float16"``: model_fn computes
        on copies of its float inputs and parameters in that dtype, while the weights, the
        optimizer state, batch statistics and checkpoints stay float32; ``"float16"`` adds
        dynamic loss scaling (docs/mixed-precision.md). Train, evaluate and predict use it;
        export serves float32 unless model_fn uses ``estimator.tpu.bfloat16_scope()``.
      num_microbatches: split each replica's batch of every training step into this many
        micro-batches run one after another, gradients averaged, one update per step
        (``global_step`` counts updates; docs/mixed-precision.md).

    TF's other arguments are accepted (keyword-only) so ported programs run unchanged:
    ``experimental_host_call_every_n_steps`` is ``host_call_every_n_steps``;
    ``tpu_job_name``, ``initial_infeed_sleep_secs``, ``eval_training_input_configuration``,
    ``experimental_allow_per_host_v2_parallel_get_next`` and ``experimental_feed_hook`` mean
    nothing here and are ignored with one warning naming them.
    """

    iterations_per_loop: int = 2
    num_shards: int | None = None
    num_cores_per_replica: int | None = None
    per_host_input_for_training: Any = InputPipelineConfig.PER_HOST_V1
    input_partition_dims: Any = None
    host_call_every_n_steps: int = 1
    unroll_loops: bool | None = False
    shard_optimizer_state: bool = False
    shard_params: bool = False
    max_staged_input_bytes: int | None = None
    compute_dtype: str | None = None
    num_microbatches: int = 1
    _: dataclasses.KW_ONLY
    tpu_job_name: Any = None
    initial_infeed_sleep_secs: Any = None
    eval_training_input_configuration: Any = None
    experimental_host_call_every_n_steps: int | None = None
    experimental_allow_per_host_v2_parallel_get_next: Any = None
    experimental_feed_hook: Any = None
    # Set by iterations_per_loop="auto" (the field then holds the bound the loops start at).
    auto_iterations_per_loop: bool = dataclasses.field(default=False, init=False, repr=False)

    def __post_init__(self):
        _warn_tf_only("TPUConfig", self, _TPU_TF_ONLY, "TPU runtime settings")
        if isinstance(self.iterations_per_loop, str) and self.iterations_per_loop == "auto":
            object.__setattr__(self, "auto_iterations_per_loop", True)
            object.__setattr__(self, "iterations_per_loop", AUTO_LOOP_MAX)
        every = self.experimental_host_call_every_n_steps
        if every is not None:  # TF's name of host_call_every_n_steps
            if self.host_call_every_n_steps not in (1, every):
                raise EstimatorValueError(
                    f"host_call_every_n_steps={self.host_call_every_n_steps} and "
                    f"experimental_host_call_every_n_steps={every} disagree; give one"
                )
            _positive_int("experimental_host_call_every_n_steps", every, allow_none=False)
            object.__setattr__(self, "host_call_every_n_steps", every)
            # Mapped once: a later replace(host_call_every_n_steps=...) must not disagree.
            object.__setattr__(self, "experimental_host_call_every_n_steps", None)
        if self.compute_dtype not in (None, "bfloat16", "float16"):
            raise EstimatorValueError(
                f"compute_dtype must be None, 'bfloat16' or 'float16', got {self.compute_dtype!r}"
            )
        _positive_int("num_microbatches", self.num_microbatches, allow_none=False)
        _positive_int("iterations_per_loop", self.iterations_per_loop, allow_none=False)
        _positive_int("max_staged_input_bytes", self.max_staged_input_bytes)
        _positive_int("num_shards", self.num_shards)
        _positive_int("num_cores_per_replica", self.num_cores_per_replica)
        _positive_int("host_call_every_n_steps", self.host_call_every_n_steps, allow_none=False)
        for name in ("shard_optimizer_state", "shard_params"):
            if not isinstance(getattr(self, name), bool):
                raise EstimatorTypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        mode = self.per_host_input_for_training
        if mode is True:
            mode = InputPipelineConfig.PER_HOST_V1
        elif mode is False:
            mode = InputPipelineConfig.PER_SHARD_V1
        try:
            mode = InputPipelineConfig(mode)
        except ValueError:
            raise EstimatorValueError(
                f"per_host_input_for_training must be an InputPipelineConfig, got {mode!r}"
            ) from None
        object.__setattr__(self, "per_host_input_for_training", mode)
        if self.input_partition_dims is not None:
            dims = self.input_partition_dims
            if not isinstance(dims, (list, tuple)) or not 1 <= len(dims) <= 2:
                raise EstimatorValueError(
                    "input_partition_dims must be a list of 1 or 2 elements "
                    f"[feature_dims, label_dims], got {dims!r}"
                )
            if not self.num_cores_per_replica:
                raise EstimatorValueError("input_partition_dims requires num_cores_per_replica")

    def replace(self, **kwargs) -> TPUConfig:
        if self.auto_iterations_per_loop and "iterations_per_loop" not in kwargs:
            kwargs["iterations_per_loop"] = "auto"  # still chosen in train
        _QUIET.on = True  # a copy: the ignored TF arguments were already warned about
        try:
            return dataclasses.replace(self, **kwargs)
        finally:
            _QUIET.on = False


AUTO_LOOP_MAX = 1000  # the longest loop iterations_per_loop="auto" runs


def auto_loop_bound(config: RunConfig) -> int:
    """The longest loop ``iterations_per_loop="auto"`` may choose: the largest divisor, at
    most ``AUTO_LOOP_MAX``, of the greatest common divisor of ``save_checkpoints_steps``,
    ``log_step_count_steps`` and ``save_summary_steps`` (those set), so that every step
    those name ends a loop.

    Example:
      >>> auto_loop_bound(RunConfig(save_summary_steps=100, log_step_count_steps=50))
      50
    """
    cadences = [
        c
        for c in (
            config.save_checkpoints_steps,
            config.log_step_count_steps,
            config.save_summary_steps,
        )
        if c
    ]
    g = math.gcd(*cadences) if cadences else AUTO_LOOP_MAX
    return max(d for d in range(1, min(g, AUTO_LOOP_MAX) + 1) if g % d == 0)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where and how a job checkpoints, logs and seeds (TF's ``tf.estimator.tpu.RunConfig``).

    Neither ``save_checkpoints_steps`` nor ``save_checkpoints_secs`` given means every 600 s,
    as in TF; a checkpoint is always written when ``train`` ends. Both given is an error.

    ``cluster`` says which job this process belongs to; the estimator joins it when it is
    built, before JAX uses a device (``estimator.cluster.cluster.start_cluster``):

    * ``None`` (default): the job the environment describes, as TF's RunConfig read
      ``TF_CONFIG``: a ``TF_CONFIG`` variable (the local launcher
      ``python -m estimator.cluster.launch`` sets one), else a cluster JAX detects (a TPU
      pod, Slurm, Open MPI, Kubernetes) of more than one process; with neither, this
      process runs alone. So a
      TF-style script runs unchanged as every process of a job. The environment variable
      ``TPU_ESTIMATOR_NO_CLUSTER=1`` turns this off.
    * a ``TPUClusterResolver`` (or anything with ``connect()``): that job.
    * ``False``: this process runs alone whatever the environment says.

    Example:
      >>> RunConfig(model_dir="/runs/a").cluster is None     # joins TF_CONFIG's job, if any
      True
      >>> alone = RunConfig(model_dir="/runs/a", cluster=False)

    Keyword-only extensions over TF's fields:
      compilation_cache_dir: where JAX's persistent compilation cache lives; it is on by
        default (``None`` or ``True``: ``$TPU_ESTIMATOR_COMPILATION_CACHE_DIR``, else
        ``~/.cache/tpu-estimator/jax``), ``False`` turns it off (``estimator.core.compilation``).
      skip_nonfinite_steps: skip (on every replica together) a step whose loss or gradients
        are not finite, count it in the ``nonfinite_steps`` summary, and keep training.
      progress_bar: a tqdm bar (``None``: when stderr is a terminal or the process is a
        Jupyter/IPython kernel, unless ``TPU_ESTIMATOR_NO_PROGRESS_BAR`` is set).
      resume_input_position: on resuming, skip the training batches already consumed.

    TF-only arguments ``master``, ``evaluation_master`` and ``session_config`` are accepted
    (keyword-only) so ported programs run unchanged; they mean nothing here and are ignored
    with one warning naming them.
    """

    model_dir: str | None = None
    tpu_config: TPUConfig | None = None
    save_checkpoints_steps: int | None = None
    save_checkpoints_secs: float | None = None
    keep_checkpoint_max: int | None = 5
    save_summary_steps: int = 100
    log_step_count_steps: int = 100
    tf_random_seed: int | None = None
    cluster: Any = None
    _: dataclasses.KW_ONLY
    compilation_cache_dir: str | bool | None = None
    skip_nonfinite_steps: bool = False
    progress_bar: bool | None = None
    resume_input_position: bool = True
    master: Any = None
    evaluation_master: Any = None
    session_config: Any = None

    def __post_init__(self):
        _warn_tf_only("RunConfig", self, _TF_ONLY, "TensorFlow session settings")
        cluster = self.cluster
        if (
            cluster is not None
            and cluster is not False
            and not callable(getattr(cluster, "connect", None))
        ):
            raise EstimatorTypeError(
                "RunConfig.cluster must be a TPUClusterResolver (or have connect()), None (the "
                f"job TF_CONFIG or JAX's detection describes) or False (alone), got {cluster!r}"
            )
        if self.tpu_config is None:
            object.__setattr__(self, "tpu_config", TPUConfig())
        if not isinstance(self.tpu_config, TPUConfig):
            raise EstimatorTypeError(f"tpu_config must be a TPUConfig, got {type(self.tpu_config)}")
        if self.model_dir is not None and (
            not isinstance(self.model_dir, (str, bytes))
            and not hasattr(self.model_dir, "__fspath__")
        ):
            raise EstimatorTypeError(f"model_dir must be a path, got {self.model_dir!r}")
        if self.model_dir is not None:
            object.__setattr__(self, "model_dir", str(self.model_dir))
            if not self.model_dir:
                raise EstimatorValueError("model_dir must be a non-empty path")
        if self.save_checkpoints_steps is not None and self.save_checkpoints_secs is not None:
            raise EstimatorValueError(
                "save_checkpoints_steps and save_checkpoints_secs cannot both be set"
            )
        _positive_int("save_checkpoints_steps", self.save_checkpoints_steps)
        if self.save_checkpoints_secs is not None and self.save_checkpoints_secs <= 0:
            raise EstimatorValueError(
                f"save_checkpoints_secs must be positive, got {self.save_checkpoints_secs}"
            )
        if self.keep_checkpoint_max is not None:
            _positive_int("keep_checkpoint_max", self.keep_checkpoint_max)
        for name in ("save_summary_steps", "log_step_count_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise EstimatorValueError(f"{name} must be a non-negative int, got {value!r}")
        cache = self.compilation_cache_dir
        if cache is not None and not isinstance(cache, (bool, str, os.PathLike)):
            raise EstimatorTypeError(
                f"compilation_cache_dir must be a path, True, False or None, got {cache!r}"
            )
        seed = self.tf_random_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise EstimatorTypeError(f"tf_random_seed must be an int, got {seed!r}")
        if seed is not None and not -(2**63) <= seed < 2**63:  # JAX's seeds are int64, as TF's
            raise EstimatorValueError(
                f"tf_random_seed must fit in 64 bits (-2**63 <= seed < 2**63, as TF's int64 "
                f"seeds), got {seed}; use a smaller seed, e.g. seed % 2**63"
            )
        if self.tpu_config.auto_iterations_per_loop:  # "auto" starts at the cadences' bound
            tpu = self.tpu_config.replace()  # a copy: the given TPUConfig may be shared
            object.__setattr__(tpu, "iterations_per_loop", auto_loop_bound(self))
            object.__setattr__(self, "tpu_config", tpu)

    @property
    def checkpoint_every_secs(self) -> float | None:
        """The effective time cadence: TF's 600 s default when no cadence is given."""
        if self.save_checkpoints_steps is None and self.save_checkpoints_secs is None:
            return 600.0
        return self.save_checkpoints_secs

    def replace(self, **kwargs) -> RunConfig:
        """A copy with fields replaced; setting one checkpoint cadence clears the other."""
        if "save_checkpoints_steps" in kwargs and "save_checkpoints_secs" not in kwargs:
            kwargs["save_checkpoints_secs"] = None
        if "save_checkpoints_secs" in kwargs and "save_checkpoints_steps" not in kwargs:
            kwargs["save_checkpoints_steps"] = None
        _QUIET.on = True  # a copy: the ignored TF arguments were already warned about
        try:
            return dataclasses.replace(self, **kwargs)
        finally:
            _QUIET.on = False
