"""Checkpoint step directories named as TF named checkpoints: ``<model_dir>/model.ckpt-<step>``.

TF programs parse the step from a checkpoint path (``int(ckpt.split("-")[-1])``) and pass
paths like ``model_dir/model.ckpt-1000`` around; each Orbax step directory here carries that
name, directly in ``model_dir``. A model_dir written before (``<model_dir>/checkpoints/<step>``)
is still read, and a trainer resuming it keeps writing that layout.

Example:
  >>> directory, names = layout("/runs/mnist")
  >>> names.build_name(1000)
  'model.ckpt-1000'
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
from collections.abc import Iterable, Iterator

from etils import epath
from orbax.checkpoint._src.path import step as step_lib

from .. import storage
from ..core.errors import EstimatorError

PREFIX = "model.ckpt-"
LEGACY_DIR = "checkpoints"  # the layout before: <model_dir>/checkpoints/<step>
_STEP = re.compile(re.escape(PREFIX) + r"(0|[1-9]\d*)")


class MissingStepError(EstimatorError, FileNotFoundError, ValueError):
    """A step directory that is not there (or not finished): Orbax's ``find_step`` contract
    raises ValueError; a FileNotFoundError too, so a step rotated away while a reader lists
    the steps reads as the file race it is."""


@dataclasses.dataclass(frozen=True)
class TFStepNames(step_lib.NameFormat):
    """An Orbax ``NameFormat`` for ``model.ckpt-<step>`` directories (only finished ones)."""

    def __str__(self) -> str:
        return f"TFStepNames({PREFIX}<step>)"

    def build_name(self, step: int) -> str:
        return f"{PREFIX}{step}"

    def _metadata(self, path: epath.Path) -> step_lib.Metadata | None:
        match = _STEP.fullmatch(path.name)
        if match is None or not path.is_dir() or not step_lib.is_path_finalized(path):
            return None
        return step_lib.Metadata(step=int(match.group(1)), path=path)

    def find_all(self, base_path: epath.PathLike) -> Iterator[step_lib.Metadata]:
        base = epath.Path(base_path)
        if not base.is_dir():
            return iter([])
        paths = [p for p in base.iterdir() if p.name.startswith(PREFIX)]
        return step_lib.build_step_metadatas(paths, self._metadata)

    def find_step(self, base_path: epath.PathLike, step: int) -> step_lib.Metadata:
        path = epath.Path(base_path) / self.build_name(step)
        found = self._metadata(path) if path.exists() else None
        if found is None:
            raise MissingStepError(f"No checkpoint {self.build_name(step)} under {base_path}")
        return found


TF_NAMES = TFStepNames()


def _has_new_steps(model_dir: str) -> bool:
    try:
        return any(_STEP.fullmatch(n) for n in storage.listdir(model_dir))
    except OSError:
        return False


def _has_legacy_steps(model_dir: str) -> bool:
    try:
        return any(n.isdigit() for n in storage.listdir(storage.join(model_dir, LEGACY_DIR)))
    except OSError:
        return False


def layout(model_dir: str) -> tuple[str, step_lib.NameFormat]:
    """``(directory, name format)`` of model_dir's checkpoints: ``model_dir`` with
    ``model.ckpt-<step>`` names, or the old ``model_dir/checkpoints`` with bare step names
    when only that holds checkpoints.

    Raises:
      NotADirectoryError: model_dir exists and is not a directory.
    """
    model_dir = storage.absolute(model_dir)
    local = not storage.is_url(model_dir)  # on a store, a prefix and an object can share a name
    if local and os.path.exists(model_dir) and not os.path.isdir(model_dir):
        raise NotADirectoryError(errno.ENOTDIR, "model_dir is not a directory", model_dir)
    if _has_legacy_steps(model_dir) and not _has_new_steps(model_dir):
        return storage.join(model_dir, LEGACY_DIR), step_lib.standard_name_format()
    return model_dir, TF_NAMES


def has_checkpoints(model_dir: str) -> bool:
    """Whether model_dir holds checkpoint step directories of either layout (finished or not)."""
    return _has_new_steps(model_dir) or _has_legacy_steps(model_dir)


def newest_finished(directory: str, names: Iterable[str]) -> int | None:
    """The newest step among ``names`` (entries of ``directory``) that is a finished
    ``model.ckpt-<step>`` directory, or None. On a local file system a step is finished once
    it has its final name (Orbax writes under a temporary name, then renames); on an object
    store, where Orbax writes the final name at once, once it holds its commit marker."""
    steps = sorted((int(m.group(1)) for m in map(_STEP.fullmatch, names) if m), reverse=True)
    for step in steps:
        if storage.finished_step(storage.join(directory, TF_NAMES.build_name(step))):
            return step
    return None


def parse_step_path(path: str) -> tuple[str, int] | None:
    """``(model_dir, step)`` of a step directory path of either layout, else None."""
    path = storage.absolute(path)
    base, parent = storage.basename(path), storage.dirname(path)
    match = _STEP.fullmatch(base)
    if match is not None:
        return parent, int(match.group(1))
    if base.isdigit() and storage.basename(parent) == LEGACY_DIR:
        return storage.dirname(parent), int(base)
    return None


__all__ = [
    "LEGACY_DIR",
    "PREFIX",
    "TFStepNames",
    "has_checkpoints",
    "layout",
    "parse_step_path",
    "newest_finished",
]


def newest_finished_path(model_dir: str) -> str | None:
    """The path of model_dir's newest finished step directory, read with listings alone (no
    Orbax manager, which waits at a barrier for every process, and no thread pool, which is
    gone at interpreter shutdown), or None.

    Example:
      >>> newest_finished_path("/runs/mnist")
      '/runs/mnist/model.ckpt-1000'
    """
    try:
        directory, names = layout(model_dir)
        entries = storage.listdir(directory)
    except OSError:
        return None
    if names is TF_NAMES:
        step = newest_finished(directory, entries)
        return None if step is None else storage.join(directory, names.build_name(step))
    steps = sorted((int(n) for n in entries if n.isdigit()), reverse=True)  # the old layout
    for step in steps:
        path = storage.join(directory, str(step))
        if storage.isdir(path) and step_lib.is_path_finalized(storage.epath_of(path)):
            return path
    return None
