"""A model_dir: which one the estimator uses, whether Orbax can use it, and its step paths.

A model_dir holds its checkpoints as ``model.ckpt-<step>/`` directories (``step_names.py``;
an older ``checkpoints/<step>/`` folder still reads). A checkpoint path names one of those
step directories, or a model_dir (meaning its newest checkpoint).

Example:
  >>> model_dir = resolve_model_dir(None, config.model_dir)  # checked before anything is written
  >>> resolve_path("/runs/a/model.ckpt-600", model_dir)
  ('/runs/a', 600)
"""

from __future__ import annotations

import logging
import tempfile

from .. import storage
from ..core.errors import EstimatorValueError, NoCheckpointError
from . import step_names

log = logging.getLogger("estimator")

_GLOB_CHARACTERS = "*?[]\\"


def checkpoint_dir(model_dir: str) -> str:
    """The directory holding model_dir's step directories (model_dir itself, or the old
    ``checkpoints/`` folder of a model_dir written before)."""
    return step_names.layout(model_dir)[0]


def check_model_dir(model_dir: str) -> None:
    """Refuses a model_dir that Orbax would write but never read back.

    Orbax globs the checkpoint directory unescaped when it finishes a step, so in a path with
    ``[``, ``]``, ``*`` or ``?`` the glob misses (or matches another directory's) files, and
    TensorStore reads a backslash as a separator.

    Raises:
      ValueError: the absolute path holds one of ``*?[]\\``.
    """
    storage.check_backend(model_dir)
    path = storage.absolute(str(model_dir))
    found = sorted({c for c in path if c in _GLOB_CHARACTERS})
    if found:
        raise EstimatorValueError(
            f"model_dir {path!r} contains {' '.join(repr(c) for c in found)}: glob characters "
            "and backslashes in a checkpoint path make checkpoints that cannot be read back "
            "(Orbax globs the path when it finishes a step). Use a directory name without "
            f"any of {' '.join(_GLOB_CHARACTERS)}."
        )


def resolve_model_dir(model_dir: str | None, configured: str | None) -> str:
    """The estimator's model_dir: the argument or ``RunConfig.model_dir`` (they must agree
    when both are given), else a new temporary directory (with a warning); checked with
    ``check_model_dir`` before anything is written there."""
    if model_dir is not None and configured is not None:
        if storage.absolute(str(model_dir)) != storage.absolute(configured):
            raise EstimatorValueError(
                f"model_dir={model_dir!r} differs from config.model_dir={configured!r}"
            )
    chosen = model_dir if model_dir is not None else configured
    if chosen is None:
        chosen = tempfile.mkdtemp(prefix="tpu_estimator_")
        log.warning("Using temporary folder as model directory: %s", chosen)
    check_model_dir(str(chosen))
    return str(chosen)


def resolve_path(checkpoint_path: str | None, model_dir: str) -> tuple[str, int | None]:
    """``(model_dir, step)`` for a checkpoint path: a step directory (``model.ckpt-<step>``,
    or an old ``checkpoints/<step>``), an old checkpoints directory, or a model_dir (meaning
    its latest). None means this estimator's latest."""
    if checkpoint_path is None:
        return model_dir, None
    path = storage.absolute(str(checkpoint_path))
    parsed = step_names.parse_step_path(path)
    if parsed is not None:
        if not storage.isdir(path):
            raise NoCheckpointError(f"checkpoint_path {checkpoint_path!r} does not exist")
        return parsed
    if storage.basename(path) == step_names.LEGACY_DIR:
        return storage.dirname(path), None
    legacy = storage.join(path, step_names.LEGACY_DIR)
    if step_names.has_checkpoints(path) or storage.isdir(legacy):
        return path, None
    raise NoCheckpointError(
        f"checkpoint_path {checkpoint_path!r} is not a checkpoint: expected "
        "<model_dir>/model.ckpt-<step> or a model_dir"
    )
