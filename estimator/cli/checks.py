"""What the command line checks before JAX is imported (this module imports neither).

Importing JAX and building the estimator takes seconds (tens of seconds on a loaded
machine); a user's mistake should not wait for it. ``check_job`` looks at the job config and
the paths with the standard library only: the run and TPU config fields (``RunConfig`` /
``TPUConfig`` validate them; ``estimator.config`` imports no JAX), batch sizes and
``max_steps``, the ``--output`` / ``--export_dir`` paths, and whether ``--model_dir`` can hold
a checkpoint at all for the commands that read one.

The checkpoint test is conservative: it only rules out a model_dir with no entry a checkpoint
could be (no ``model.ckpt-<step>`` and no ``checkpoints/<step>``, the two layouts of
``estimator/io/step_names.py``). Anything else goes on to the estimator, which decides
(an unfinished or mismatched checkpoint is still reported there).

Example:
  >>> check_job("evaluate", config, model_dir="/tmp/empty")   # raises NoCheckpointError
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..config import RunConfig, TPUConfig
from ..errors import EstimatorError, NoCheckpointError
from .usage import PROG, UsageError

READS_A_MODEL = ("evaluate", "predict", "export")
TRAINS = ("train", "train_and_evaluate")

# config field -> RunConfig / TPUConfig argument; a field the config lacks keeps the default.
RUN_CONFIG_FIELDS = {
    "save_checkpoints_steps": "save_checkpoints_steps",
    "keep_checkpoint_max": "keep_checkpoint_max",
    "save_summary_steps": "save_summary_steps",
    "log_step_count_steps": "log_step_count_steps",
    "seed": "tf_random_seed",
    "compilation_cache_dir": "compilation_cache_dir",
}
TPU_CONFIG_FIELDS = {
    "iterations_per_loop": "iterations_per_loop",
    "num_cores_per_replica": "num_cores_per_replica",
    "host_call_every_n_steps": "host_call_every_n_steps",
    "unroll_loops": "unroll_loops",
    "shard_optimizer_state": "shard_optimizer_state",
    "shard_params": "shard_params",
    "compute_dtype": "compute_dtype",
    "num_microbatches": "num_microbatches",
}
# The step directory names of estimator/io/step_names.py (which imports Orbax, hence JAX).
_STEP = re.compile(r"model\.ckpt-(0|[1-9]\d*)")
_LEGACY_DIR = "checkpoints"


class NoCheckpointInModelDir(UsageError, NoCheckpointError):
    """``--model_dir`` holds no checkpoint for a command that reads one: a usage mistake
    found before JAX (one line, exit status 2, no traceback to offer)."""


def given_fields(config: Any, fields: dict[str, str]) -> dict:
    """The ``fields`` (config key -> argument) the config sets, as arguments.

    0 / "" mean "not set" for the optional ``num_cores_per_replica``, ``compute_dtype`` and
    ``compilation_cache_dir`` (None cannot be overridden from the command line with a typed
    value).
    """
    unset = {"num_cores_per_replica": 0, "compilation_cache_dir": "", "compute_dtype": ""}
    return {
        arg: config[key]
        for key, arg in fields.items()
        if key in config and config[key] != unset.get(key, object())
    }


def may_hold_checkpoint(model_dir: str) -> bool:
    """False only when ``model_dir`` certainly holds no checkpoint (missing, or no step
    directory of either layout); True for a remote path (``gs://``: left to the estimator)."""
    if "://" in model_dir:
        return True
    try:
        if any(_STEP.fullmatch(n) for n in os.listdir(model_dir)):
            return True
    except OSError:
        return False
    try:
        return any(n.isdigit() for n in os.listdir(os.path.join(model_dir, _LEGACY_DIR)))
    except OSError:
        return False


def check_job(
    command: str,
    config: Any,
    *,
    model_dir: str | None,
    output: str | None = None,
    export_dir: str | None = None,
) -> None:
    """Raises the error ``command`` would end with, where finding it needs no JAX.

    Raises:
      UsageError: a config field, a batch size, ``max_steps`` or a path that cannot work.
      NoCheckpointInModelDir: (a UsageError and a NoCheckpointError) ``command`` reads a
        model and ``model_dir`` holds no checkpoint.
    """
    try:
        RunConfig(
            model_dir=model_dir,
            tpu_config=TPUConfig(**given_fields(config, TPU_CONFIG_FIELDS)),
            **given_fields(config, RUN_CONFIG_FIELDS),
        )
    except (EstimatorError, TypeError, ValueError) as e:
        raise UsageError(f"the job config: {e}") from None
    _check_counts(command, config)
    if output not in (None, "-") and "://" not in output:  # a URL: checked when written
        parent = os.path.dirname(os.path.abspath(output))
        if not os.path.isdir(parent):
            raise UsageError(f"--output {output}: the directory {parent} does not exist")
    local_export = export_dir is not None and "://" not in export_dir
    if local_export and os.path.exists(export_dir) and not os.path.isdir(export_dir):
        raise UsageError(f"--export_dir {export_dir} is a file, not a directory")
    if command in READS_A_MODEL and model_dir is not None and not may_hold_checkpoint(model_dir):
        raise NoCheckpointInModelDir(
            f"Could not find trained model in model_dir: {model_dir} (train one with: "
            f"{PROG} train --model_dir {model_dir})"
        )


def _check_counts(command: str, config: Any) -> None:
    """Batch sizes of the modes ``command`` runs and ``max_steps``, where set: positive whole
    numbers."""
    names = {
        "train": ("train_batch_size", "max_steps"),
        "train_and_evaluate": ("train_batch_size", "eval_batch_size", "max_steps"),
        "evaluate": ("eval_batch_size",),
        "predict": ("predict_batch_size",),
    }.get(command, ())
    for name in names:
        value = config.get(name, None)
        if value is None:
            continue  # not set: the estimator's default (or its own error)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"--config.{name}={value!r}: expected a positive whole number")


__all__ = [
    "READS_A_MODEL",
    "NoCheckpointInModelDir",
    "RUN_CONFIG_FIELDS",
    "TPU_CONFIG_FIELDS",
    "check_job",
    "given_fields",
    "may_hold_checkpoint",
]
