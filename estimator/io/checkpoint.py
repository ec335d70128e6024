"""Checkpoints with Orbax: atomic, asynchronous, and never a broken one loaded.

Layout: ``<model_dir>/model.ckpt-<step>/`` (TF's checkpoint names, see ``step_names``; an
older ``<model_dir>/checkpoints/<step>/`` still reads) with three items: ``variables`` (params
and every other collection), ``train`` (optimizer state, RNG, counters) and ``meta`` (JSON:
global step, input position). Orbax writes ``<name>.orbax-checkpoint-tmp`` and renames it
when complete, so a reader (another process evaluating, say) never sees a half-written step.

A step that is present but damaged (a truncated or missing file, a missing item, garbage in
``_CHECKPOINT_METADATA``, ``_METADATA``, the OCDBT manifest or ``meta``) is never loaded: the
newest readable step is used instead, with a warning naming the skipped step. A trainer moves
a damaged step aside to ``<step>.unreadable`` (so it can write that step again); nothing is
ever deleted because it could not be read. When no step is readable,
``CheckpointError`` is raised instead of silently starting over.

A readable checkpoint of a *different* model (other variable names or shapes, another
optimizer) raises ``CheckpointMismatchError`` naming every difference; it is never skipped.

Reading by variable name (a Saver's mapping, the moving averages) is ``checkpoint_read.py``;
which model_dir, and whether Orbax can use it, is ``model_dir.py``.

Example:
  >>> ckpts = Checkpoints("/tmp/run", read_only=True)
  >>> step, out = ckpts.restore_latest(variables=template)
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from .. import storage
from ..core._compat import absl_warning_dropped, standard_handler_with_array_handler
from ..core.errors import CheckpointError, CheckpointMismatchError
from . import disk_full, local_read, orbax_noise, step_names
from . import variables as variables_lib
from .meta_format import checked_meta, load_json, with_checksum
from .model_dir import check_model_dir

log = logging.getLogger("estimator")

ITEMS = ("variables", "train", "meta")
MAX_LISTED = 8
# Rotated steps are renamed in here (atomically: a reader sees a step whole or not at all),
# then deleted by the writer.
_ROTATED = ".rotated"
_LISTING_ATTEMPTS = 20


def _abstract(tree: Any) -> Any:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def short_error(error: BaseException) -> str:
    """One line of an Orbax/TensorStore error (their specs run to kilobytes)."""
    text = f"{type(error).__name__}: {error}".split(" [tensorstore_spec")[0]
    return text if len(text) <= 400 else text[:400] + "..."


def _is_empty(x: Any) -> bool:
    """None, or a node without arrays (optax's ``EmptyState()``, an empty collection)."""
    return x is None or (not hasattr(x, "shape") and not jax.tree.leaves(x))


def _skeleton(tree: Any) -> dict[str, tuple | None]:
    """Like ``_shapes`` by path, and ``name -> None`` for each empty node: two optimizers with
    the same slots but another chain (Adam against AdamW) differ here."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_empty)[0]
    return {
        variables_lib.path_name(path): None if _is_empty(x) else tuple(getattr(x, "shape", ()))
        for path, x in leaves
    }


def _shapes(tree: Any, item: str) -> dict[str, tuple]:
    """``name -> shape`` of every array leaf: variables by their public names (see
    ``io/variables.py``), the rest by path (``opt_state/0/mu/dense/kernel``)."""
    if item == "variables":
        return variables_lib.shapes(tree)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        variables_lib.path_name(path): tuple(getattr(x, "shape", ()))
        for path, x in leaves
        if x is not None
    }


def describe_mismatch(saved: dict[str, tuple], wanted: dict[str, tuple], item: str) -> list[str]:
    """Every difference between a checkpoint's arrays and the model's, one line each."""
    out = []
    for name in sorted(set(saved) | set(wanted)):
        label = name if item == "variables" else f"{item}/{name}"  # variables: public names
        if name not in wanted:
            out.append(f"{label}: in the checkpoint, not in the model")
        elif name not in saved:
            shape = "(an empty state)" if wanted[name] is None else wanted[name]
            out.append(f"{label}: in the model {shape}, not in the checkpoint")
        elif saved[name] is None or wanted[name] is None:
            if saved[name] != wanted[name]:
                out.append(f"{label}: an empty state in one, arrays in the other")
        elif tuple(saved[name]) != tuple(wanted[name]):
            out.append(f"{label}: checkpoint shape {saved[name]}, model shape {wanted[name]}")
    return out


def _handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """The handlers of our three items, for our managers only.

    On CPU the arrays are saved without Orbax's replica-parallel slicing: it compiles a
    slice program per device and array shape on the first save (most of a small job's
    start-up compiles, 2.35 s and 87 MiB against 0.13 s and 6 MiB measured) and only pays off
    when many accelerators share the writing. The choice stays inside these handlers; Orbax's
    process-wide type-handler registry is left as the application has it.
    """
    cpu = jax.default_backend() == "cpu"
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item in ITEMS[:2]:
        handler = (
            standard_handler_with_array_handler(
                ocp.type_handlers.ArrayHandler(use_replica_parallel=False)
            )
            if cpu
            else ocp.StandardCheckpointHandler()
        )
        registry.add(item, ocp.args.StandardSave, handler)
        registry.add(item, ocp.args.StandardRestore, handler)
    meta = ocp.JsonCheckpointHandler()
    registry.add(ITEMS[2], ocp.args.JsonSave, meta)
    registry.add(ITEMS[2], ocp.args.JsonRestore, meta)
    return registry


def _listing(fn: Callable[[], Any]) -> Any:
    """Runs ``fn``, which lists the steps (Orbax reads each step's metadata as it lists),
    again when a writer rotated a listed step away before it was read (Orbax reports that as
    FileNotFoundError, or NotADirectoryError when it checks the step directory first)."""
    for attempt in range(_LISTING_ATTEMPTS):
        try:
            return fn()
        except (FileNotFoundError, NotADirectoryError):
            if attempt == _LISTING_ATTEMPTS - 1:
                raise
            time.sleep(0.002 * (attempt + 1))


def _entries(directory: str) -> set[str]:
    try:
        return set(storage.listdir(directory))
    except FileNotFoundError:
        return set()


class Checkpoints:
    """One model_dir's checkpoints.

    Args:
      model_dir: the estimator's directory.
      max_to_keep: how many to keep (None keeps all).
      read_only: a reader (evaluate, predict, another process) never deletes, moves or writes.
    """

    def __init__(self, model_dir: str, *, max_to_keep: int | None = 5, read_only: bool = False):
        check_model_dir(model_dir)
        orbax_noise.install()  # a damaged step's failed read leaves closed-loop tracebacks
        disk_full.drop_orbax_disk_full_records()  # we raise one error naming the path instead
        self._writing: int | None = None  # the step of the save in flight
        self._full: OSError | None = None  # a full disk, once reported
        self.directory, self._names = step_names.layout(model_dir)
        self.read_only = read_only
        options = ocp.CheckpointManagerOptions(
            step_name_format=self._names,
            # A reader saves and deletes nothing; saying so keeps Orbax from warning that it
            # changed these two for us.
            max_to_keep=None if read_only else max_to_keep,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=not read_only,
            read_only=read_only,
            create=not read_only,
            cleanup_tmp_directories=not read_only,  # only unfinished *.orbax-checkpoint-tmp
            todelete_subdir=None if read_only else _ROTATED,
            # A reader is this process's alone: no barrier waits for the others (local_read).
            multiprocessing_options=local_read.process_local_options()
            if read_only
            else ocp.options.MultiprocessingOptions(),
        )
        # Orbax warns "Given directory is read only" for every reader: a newcomer reads it as a
        # permissions problem, and a reader is read-only by design.
        with absl_warning_dropped("Given directory is read only"):
            self._manager = _listing(
                lambda: ocp.CheckpointManager(
                    self.directory, options=options, handler_registry=_handler_registry()
                )
            )
        self._handler = ocp.StandardCheckpointHandler()
        self._warned: set[int] = set()

    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first.

        Orbax lists the directory, then reads each step's metadata: a step a writer rotates
        away meanwhile makes the listing fail or miss it (a listing taken while step 8 is
        renamed into place and step 6 away can hold neither). The directory is listed again
        until no step came or went while it was being listed.
        """
        for _ in range(_LISTING_ATTEMPTS):
            before = _entries(self.directory)
            _listing(self._manager.reload)
            if _entries(self.directory) == before:  # nothing renamed or removed meanwhile
                break
        return sorted(self._manager.all_steps())

    def newest_step(self) -> int | None:
        """The newest complete checkpoint's step, from one directory listing: cheaper than
        ``steps()[-1]``, which reads every step's metadata (evaluate, ``latest_checkpoint``
        and the checkpoint pollers ask it)."""
        if self._names is not step_names.TF_NAMES:  # the old layout: Orbax lists it
            steps = self.steps()
            return steps[-1] if steps else None
        return step_names.newest_finished(self.directory, _entries(self.directory))

    def path(self, step: int) -> str:
        """The step's directory: ``<model_dir>/model.ckpt-<step>`` (TF's name)."""
        return storage.join(self.directory, self._names.build_name(step))

    def save(self, step: int, variables: dict, train: dict, meta: dict) -> bool:
        """Starts an asynchronous save (arrays are copied off the devices before it returns).

        ``meta`` is stored with a checksum (see ``with_checksum``). Returns False when the
        step is already saved.

        Raises:
          CheckpointError: Orbax declined to save the step (a newer step is on disk).
        """
        if step in self._manager.all_steps():
            return False
        self._wait()  # Orbax waits too; the last rotation is done
        self._purge_rotated()
        self._writing = step
        # Recorded so that evaluate can skip reading the train item's metadata for a shadow.
        meta = {**meta, "moving_average": variables_lib.has_moving_average(train)}
        try:
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(
                    variables=ocp.args.StandardSave(variables),
                    train=ocp.args.StandardSave(train),
                    meta=ocp.args.JsonSave(with_checksum(meta)),
                ),
            )
        except Exception as e:  # noqa: BLE001 - a full disk is named; the rest as raised
            self._raise_if_full(e)
            raise
        if not saved:
            newest = self._manager.latest_step()
            raise CheckpointError(
                f"checkpoint step {step} was not saved in {self.directory}: the newest is "
                f"{newest} (written by another trainer?); Orbax saves only newer steps"
            )
        return True

    def _purge_rotated(self) -> None:
        """Deletes the steps rotation renamed away (once a reader could no longer see them)."""
        if self.read_only or jax.process_index() != 0:
            return
        if not storage.is_url(self.directory):  # Orbax deletes at once on a store
            storage.rmtree(storage.join(self.directory, _ROTATED))

    def _wait(self) -> None:
        """Waits for the save in flight; a full disk is one clear ``OSError`` (once)."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - a full disk is named; the rest as raised
            if self._full is not None and disk_full.is_disk_full(e):
                return  # reported already: the cleanup after it must not raise it again
            self._raise_if_full(e)
            raise

    def _raise_if_full(self, error: Exception) -> None:
        if not disk_full.is_disk_full(error):
            return
        failed = self._writing
        path = self.path(failed) if failed is not None else self.directory
        intact = [s for s in self._manager.all_steps() if s != failed]
        self._full = disk_full.disk_full_error(path, intact_step=max(intact, default=None))
        raise self._full from None

    def wait(self) -> None:
        self._wait()
        self._purge_rotated()

    def close(self) -> None:
        self._wait()
        self._manager.close()
        self._purge_rotated()

    # ----------------------------------------------------------------- integrity
    def meta(self, step: int) -> dict:
        """The JSON meta of one step, checked against its directory name.

        Raises:
          CheckpointError: an item is missing, a metadata file is not JSON, or the meta's
            ``global_step`` is not the step.
        """
        path = self.path(step)
        for item in ITEMS:
            if not storage.isdir(storage.join(path, item)):
                raise CheckpointError(f"checkpoint {path} is incomplete: item {item!r} is missing")
        files = {}
        for name in (
            "_CHECKPOINT_METADATA",
            "variables/_METADATA",
            "train/_METADATA",
            "meta/metadata",
        ):
            try:
                files[name] = load_json(storage.join(path, name), name, path)
            except (OSError, ValueError) as e:
                raise CheckpointError(
                    f"checkpoint {path}: {name} is unreadable ({short_error(e)})"
                ) from e
        meta = files["meta/metadata"]
        if not isinstance(meta, dict) or meta.get("global_step") != step:
            raise CheckpointError(
                f"checkpoint {path}: meta {str(meta)[:100]!r} does not name global step {step}"
            )
        return checked_meta(meta, path=path)

    def item_metadata(self, step: int, item: str) -> Any:
        """The saved tree of one item, with shape/dtype metadata at the leaves."""
        try:
            return self._handler.metadata(epath.Path(self.path(step)) / item).tree
        except Exception as e:  # noqa: BLE001 - Orbax/TensorStore raise many types
            raise CheckpointError(
                f"checkpoint {self.path(step)}: {item} metadata is unreadable ({short_error(e)})"
            ) from e

    def _host_template(self, step: int, item: str = "variables") -> Any:
        """numpy leaves shaped like the saved arrays: Orbax then restores onto the host."""
        return jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), self.item_metadata(step, item))

    def saved_shapes(self, step: int, item: str) -> dict[str, tuple]:
        """``name -> shape`` of the item's saved arrays (see ``_shapes``), from its metadata."""
        return _shapes(self.item_metadata(step, item), item)

    def host_item(self, step: int, item: str) -> Any:
        """One item of one step as numpy arrays on the host, whatever devices wrote it
        (Orbax's error as it raises it: the caller names what failed)."""
        args = ocp.args.StandardRestore(self._host_template(step, item))
        return self._manager.restore(step, args=ocp.args.Composite(**{item: args}))[item]

    def check_matches(self, step: int, *, variables: Any, train: Any = None) -> None:
        """Raises CheckpointMismatchError when the step holds another model's arrays."""
        problems = []
        pairs = [("variables", variables)] + ([("train", train)] if train is not None else [])
        for item, template in pairs:
            problems += describe_mismatch(
                self.saved_shapes(step, item), _shapes(template, item), item
            )
        if problems:
            listed = "; ".join(problems[:MAX_LISTED])
            more = f"; and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
            raise CheckpointMismatchError(
                f"checkpoint {self.path(step)} does not match the model ({len(problems)} "
                f"difference(s)): {listed}{more}. It was written by a different model_fn, params "
                "or train_op; use a new model_dir, or warm_start_from to load matching variables."
            )

    # ----------------------------------------------------------------- restore
    def restore(
        self,
        step: int,
        *,
        variables: Any = None,
        train: Any = None,
        meta: dict | None = None,
    ) -> dict:
        """Restores one step into the given templates (arrays or shape/dtype/sharding structs).

        With ``variables=None`` the saved arrays are restored as numpy arrays on the host,
        whatever devices or processes wrote them (a pod's checkpoint reads on a laptop).
        ``meta``: the step's ``meta(step)``, when the caller has read it already (a reader
        choosing between this and a read by name, ``io/restore.py``).

        Raises:
          CheckpointMismatchError: the step holds a different model's variables.
          CheckpointError: the step is unreadable, naming why.
        """
        meta = self.meta(step) if meta is None else meta
        if variables is not None:
            self.check_matches(step, variables=variables, train=train)
        args = {
            "variables": ocp.args.StandardRestore(
                self._host_template(step) if variables is None else _abstract(variables)
            )
        }
        if train is not None:
            args["train"] = ocp.args.StandardRestore(_abstract(train))
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:  # noqa: BLE001 - Orbax raises many types; we name the step
            if variables is not None:
                self._check_structure(step, variables=variables, train=train)
            raise CheckpointError(
                f"checkpoint {self.path(step)} could not be restored: {short_error(e)}"
            ) from e
        return {**{k: out[k] for k in args}, "meta": meta}

    def _check_structure(self, step: int, *, variables: Any, train: Any) -> None:
        """After a failed restore: a tree that differs only in its empty nodes (another
        optimizer chain with the same slots) is a mismatch, not damage."""
        problems = []
        pairs = [("variables", variables)] + ([("train", train)] if train is not None else [])
        for item, template in pairs:
            try:
                saved = self._handler.metadata(epath.Path(self.path(step)) / item).tree
            except Exception:  # noqa: BLE001 - unreadable metadata is damage, reported by caller
                return
            problems += describe_mismatch(_skeleton(saved), _skeleton(template), item)
        if problems:
            raise CheckpointMismatchError(
                f"checkpoint {self.path(step)} does not match the model ({len(problems)} "
                f"difference(s)): {'; '.join(problems[:MAX_LISTED])}. It was written by a "
                "different model_fn, params or train_op (another optimizer?); use a new "
                "model_dir, or warm_start_from to load matching variables."
            )

    def verify(self, step: int) -> dict:
        """Reads every array of one step onto the host (the whole checkpoint, once) and
        returns its meta; a damaged step raises ``CheckpointError``."""
        meta = self.meta(step)
        args = {
            item: ocp.args.StandardRestore(self._host_template(step, item)) for item in ITEMS[:2]
        }
        try:
            self._manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:  # noqa: BLE001 - Orbax raises many types; we name the step
            raise CheckpointError(
                f"checkpoint {self.path(step)} could not be restored: {short_error(e)}"
            ) from e
        return meta

    def _vanished(self, step: int) -> bool:
        """Whether ``step`` was rotated away (by a writer) since it was listed."""
        if storage.isdir(self.path(step)):
            return False
        log.info("Checkpoint %d was removed while being read; trying a newer one.", step)
        return True

    def _warn(self, step: int, error: CheckpointError) -> None:
        if step not in self._warned:
            log.warning("Skipping unreadable checkpoint at step %d: %s", step, error)
            self._warned.add(step)

    def _quarantine(self, step: int) -> None:
        """Moves a damaged step to ``<step>.unreadable`` so the step can be written again."""
        if self.read_only or not storage.isdir(self.path(step)):
            return
        target = self.path(step) + ".unreadable"
        n = 0
        while storage.exists(target):
            n += 1
            target = f"{self.path(step)}.unreadable.{n}"
        try:
            storage.rename(self.path(step), target)
        except FileNotFoundError:  # another process of the job moved it first
            self._manager.reload()
            return
        log.warning(
            "Moved the unreadable checkpoint %s aside to %s (nothing is deleted).",
            self.path(step),
            target,
        )
        self._manager.reload()

    def _newest_first(self) -> Iterator[int]:
        """Steps newest first, each once, listing again before each: a writer may have saved
        or rotated steps while the previous one was being read."""
        tried: set[int] = set()
        while candidates := [s for s in reversed(self.steps()) if s not in tried]:
            tried.add(candidates[0])
            yield candidates[0]

    def latest_verified(self) -> tuple[int, dict] | None:
        """``(step, meta)`` of the newest step whose arrays all read back (see ``verify``);
        damaged newer steps are skipped with a warning and, for a writer, moved aside.

        Raises:
          CheckpointError: steps exist but none reads back.
        """
        skipped = []
        for s in self._newest_first():
            try:
                meta = self.verify(s)
            except CheckpointError as e:
                if not self._vanished(s):
                    self._warn(s, e)
                    skipped.append(s)
                continue
            for bad in skipped:
                self._quarantine(bad)
            return s, meta
        if skipped:
            raise CheckpointError(
                f"no readable checkpoint in {self.directory} (steps {sorted(skipped)}); "
                "refusing to start over existing work"
            )
        return None

    def latest_meta(self) -> tuple[int, dict] | None:
        """``(step, meta)`` of the newest step whose files look intact (a cheap check).

        Raises:
          CheckpointError: steps exist but none looks intact.
        """
        steps = self.steps()
        for s in reversed(steps):
            try:
                return s, self.meta(s)
            except CheckpointError as e:
                if not self._vanished(s):
                    self._warn(s, e)
        if steps:
            raise CheckpointError(
                f"no readable checkpoint in {self.directory} (steps {steps}); "
                "refusing to start over existing work"
            )
        return None

    def restore_latest(
        self,
        *,
        variables: Any = None,
        train: Any = None,
        step: int | None = None,
        quarantine: bool = False,
        read: Callable[[int], dict] | None = None,
    ) -> tuple[int, dict] | None:
        """The newest readable checkpoint (or ``step``), skipping broken ones with a warning.

        Args:
          variables, train: see ``restore``.
          step: restore exactly this step (no fallback).
          quarantine: move damaged steps aside (trainers only; readers never touch files).
          read: restores one step instead of ``restore`` into ``variables`` and ``train``
            (evaluate's read by name, ``io/restore.py``); it raises as ``restore`` does.

        Returns None when there is no checkpoint at all.

        Raises:
          CheckpointMismatchError: the newest readable step is another model's.
          CheckpointError: checkpoints exist but none can be read (never a silent fresh start).
        """
        if read is None:
            read = functools.partial(self.restore, variables=variables, train=train)
        if step is not None:
            return step, read(step)
        errors, skipped = [], []
        for s in self._newest_first():
            try:
                out = read(s)
            except CheckpointMismatchError:
                raise
            except CheckpointError as e:
                if self._vanished(s):
                    continue
                self._warn(s, e)
                errors.append(str(e))
                skipped.append(s)
                continue
            for bad in skipped if quarantine else ():  # only once a good step was found
                self._quarantine(bad)
            return s, out
        if not errors:
            return None
        raise CheckpointError(
            f"no readable checkpoint in {self.directory}; refusing to start over existing work. "
            + " | ".join(errors)
        )
