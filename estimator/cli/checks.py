"""What the command line checks before JAX is imported (this module imports neither).

Importing JAX and building the estimator takes seconds (tens of seconds on a loaded
machine); a user's mistake should not wait for it. ``check_job`` looks at the job config and
the paths with the standard library only: the run and TPU config fields (``RunConfig`` /
``TPUConfig`` validate them; ``estimator.core.config`` imports no JAX), batch sizes, ``max_steps``
and whether ``num_microbatches`` divides the train batch, the ``--output`` / ``--export_dir``
paths (an ``--output`` that cannot be written fails before predicting, not after), whether
``--model_dir`` can be created and written for the commands that train (a full disk, a path
under ``/proc``), and whether it can hold a checkpoint at all for the commands that read one.
The config is checked first and the paths last, so a config mistake leaves no model_dir made.

The checkpoint test is conservative: it only rules out a model_dir with no entry a checkpoint
could be (no ``model.ckpt-<step>`` and no ``checkpoints/<step>``, the two layouts of
``estimator/io/step_names.py``). Anything else goes on to the estimator, which decides
(an unfinished or mismatched checkpoint is still reported there).

Example:
  >>> check_job("evaluate", config, model_dir="/tmp/empty")   # raises NoCheckpointError
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
from typing import Any

from ..core.config import RunConfig, TPUConfig
from ..core.errors import EstimatorError, NoCheckpointError
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
    value); ``none`` / ``None`` / ``float32`` too for ``compute_dtype``.
    """
    return {
        arg: config[key]
        for key, arg in fields.items()
        if key in config and not _unset(key, config[key])
    }


# Values that mean "not set" (None cannot be typed into a str field from the command line):
# ``--config.compute_dtype=none`` (or None, float32) is float32 again.
_UNSET = {
    "num_cores_per_replica": (0,),
    "compilation_cache_dir": ("",),
    "compute_dtype": ("", "none", "float32"),
}


def _unset(key: str, value: Any) -> bool:
    if value is None and key in _UNSET:
        return True
    text = value.lower() if isinstance(value, str) else value
    return any(text == u and type(text) is type(u) for u in _UNSET.get(key, ()))


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
        raise UsageError(f"{_config_flag(str(e), config)}{e}") from None
    _check_counts(command, config)
    # Paths last: a config mistake must not leave a model_dir made.
    if output not in (None, "-") and "://" not in output:  # a URL: checked when written
        check_output(output)
    local_export = export_dir is not None and "://" not in export_dir
    if local_export and os.path.exists(export_dir) and not os.path.isdir(export_dir):
        raise UsageError(f"--export_dir {export_dir} is a file, not a directory")
    if command in TRAINS and model_dir is not None and "://" not in model_dir:
        check_writable_dir("--model_dir", model_dir)
    if command in READS_A_MODEL and model_dir is not None and not may_hold_checkpoint(model_dir):
        raise NoCheckpointInModelDir(
            f"Could not find trained model in model_dir: {model_dir} (train one with: "
            f"{PROG} train --model_dir {model_dir})"
        )


def _config_flag(message: str, config: Any) -> str:
    """``--config.KEY=VALUE: `` for the field a RunConfig/TPUConfig error names (the config's
    ``seed`` is ``tf_random_seed``), or ``the job config: ``."""
    for key, arg in {**RUN_CONFIG_FIELDS, **TPU_CONFIG_FIELDS}.items():
        if message.startswith(arg) and key in config:
            return f"--config.{key}={config[key]!r}: "
    return "the job config: "


def check_output(output: str) -> None:
    """``--output`` can be written: its directory exists and the file can be opened for
    writing (``/proc/1/mem`` cannot), found before predicting rather than after.

    Nothing is changed: an existing file is opened without truncating it, a new one is
    created and removed again.
    """
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise UsageError(f"--output {output}: the directory {parent} does not exist")
    if os.path.isdir(output):
        raise UsageError(f"--output {output} is a directory; give a file name in it")
    existed = os.path.exists(output)
    if existed and not os.path.isfile(output):
        return  # a device or pipe (/dev/stdout): opened when written
    try:
        flags = os.O_WRONLY | (os.O_APPEND if existed else os.O_CREAT | os.O_EXCL)
        os.close(os.open(output, flags | os.O_NONBLOCK, 0o644))
    except OSError as e:
        raise UsageError(
            f"--output {output}: cannot be written ({e.strerror}); give a file in a directory "
            "you can write, or - for stdout"
        ) from None
    if not existed:
        os.remove(output)


def check_writable_dir(flag: str, path: str) -> None:
    """``path`` is (or can be made) a directory this process can write a file into.

    Makes the directory (training would make it next) and writes and removes one byte, so a
    full disk or a path that cannot hold files (``/proc/self/x``) is one line now rather than
    an ``OSError`` without a path after JAX started. Directories it made are removed again
    when the write fails.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a file, not a directory")
    made = []  # the missing directories, deepest first
    parent = os.path.abspath(path)
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        made.append(parent)
        parent = os.path.dirname(parent)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot be made a directory ({e.strerror})") from None
    # Random: the processes of a many-host job check one shared model_dir at once.
    probe = os.path.join(path, f".tpu-estimator-write-test-{secrets.token_hex(8)}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        for d in made:
            with contextlib.suppress(OSError):
                os.rmdir(d)
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        fix = "free space on its disk" if full else "give a directory you can write"
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror}); {fix}") from None


def _check_counts(command: str, config: Any) -> None:
    """Batch sizes of the modes ``command`` runs and ``max_steps``, where set: positive whole
    numbers; ``num_microbatches`` divides the train batch (each replica's batch is a part of
    it, so a count that does not divide the whole cannot divide a replica's)."""
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
    micro, batch = config.get("num_microbatches", 1), config.get("train_batch_size", None)
    if command in TRAINS and isinstance(micro, int) and micro > 1 and isinstance(batch, int):
        if batch % micro:
            raise UsageError(
                f"--config.num_microbatches={micro} must divide the train batch "
                f"(train_batch_size={batch}, split over the replicas): use a batch size that "
                f"is a multiple of {micro} times the replicas, or a count that divides it"
            )


__all__ = [
    "READS_A_MODEL",
    "NoCheckpointInModelDir",
    "RUN_CONFIG_FIELDS",
    "TPU_CONFIG_FIELDS",
    "check_job",
    "check_output",
    "check_writable_dir",
    "given_fields",
    "may_hold_checkpoint",
]
