"""Checkpoints with Orbax: atomic, asynchronous, and never a broken one loaded.

Layout: ``<model_dir>/checkpoints/<step>/`` with three items: ``variables`` (params and every
other collection), ``train`` (optimizer state, RNG, counters) and ``meta`` (JSON: global step,
input position). Orbax writes ``<step>.orbax-checkpoint-tmp`` and renames it when complete,
so a reader never sees a half-written step; a step that is present but unreadable (truncated
or garbage files) is skipped with a warning and the previous one is used.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger("estimator")


class CheckpointError(RuntimeError):
    """No readable checkpoint where one was expected."""


def checkpoint_dir(model_dir: str) -> str:
    return os.path.join(os.path.abspath(model_dir), "checkpoints")


def _abstract(tree: Any) -> Any:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpoints:
    """One model_dir's checkpoints.

    Args:
      model_dir: the estimator's directory.
      max_to_keep: how many to keep (None keeps all).
      read_only: a reader (evaluate, predict, another process) never deletes or writes.
    """

    def __init__(self, model_dir: str, *, max_to_keep: int | None = 5, read_only: bool = False):
        self.directory = checkpoint_dir(model_dir)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=not read_only,
            read_only=read_only,
            create=not read_only,
            cleanup_tmp_directories=not read_only,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("variables", "train", "meta")
        )

    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def save(self, step: int, variables: dict, train: dict, meta: dict) -> bool:
        """Starts an asynchronous save (arrays are copied off the devices before it returns)."""
        if step in self._manager.all_steps():
            return False
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                variables=ocp.args.StandardSave(variables),
                train=ocp.args.StandardSave(train),
                meta=ocp.args.JsonSave(meta),
            ),
        )

    def meta(self, step: int) -> dict:
        """The JSON meta of one step ({} when it cannot be read)."""
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            return dict(out["meta"])
        except Exception as e:  # noqa: BLE001
            log.warning("Could not read the meta of checkpoint %d: %s", step, e)
            return {}

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def restore(self, step: int, *, variables: Any, train: Any = None) -> dict:
        """Restores one step into the given templates (arrays or shape/dtype/sharding structs).

        Raises:
          CheckpointError: the step is unreadable or does not match the templates, naming why.
        """
        args = {"variables": ocp.args.StandardRestore(_abstract(variables)),
                "meta": ocp.args.JsonRestore()}
        if train is not None:
            args["train"] = ocp.args.StandardRestore(_abstract(train))
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:  # noqa: BLE001 - Orbax raises many types; we name the step
            raise CheckpointError(
                f"checkpoint {self.path(step)} could not be restored: {type(e).__name__}: {e}"
            ) from e
        return {k: out[k] for k in args}

    def restore_latest(self, *, variables: Any, train: Any = None,
                       step: int | None = None) -> tuple[int, dict] | None:
        """The newest readable checkpoint (or ``step``), skipping broken ones with a warning.

        Returns None when there is no checkpoint at all.

        Raises:
          CheckpointError: checkpoints exist but none can be read (never a silent fresh start).
        """
        candidates = [step] if step is not None else list(reversed(self.steps()))
        if not candidates:
            return None
        errors = []
        for s in candidates:
            try:
                return s, self.restore(s, variables=variables, train=train)
            except CheckpointError as e:
                if _is_mismatch(e):
                    raise
                log.warning("Skipping unreadable checkpoint at step %d: %s", s, e)
                errors.append(str(e))
        raise CheckpointError(
            f"no readable checkpoint in {self.directory}; refusing to start over existing work. "
            + " | ".join(errors)
        )


def _is_mismatch(error: Exception) -> bool:
    """A well-formed checkpoint of a different model: falling back would not help."""
    text = str(error.__cause__ or error)
    return "tree structure" in text.lower() or "structure" in text.lower() and "match" in text


def resolve_path(checkpoint_path: str | None, model_dir: str) -> tuple[str, int | None]:
    """``(model_dir, step)`` for a checkpoint path: a step directory, a checkpoints
    directory or a model_dir (meaning its latest). None means this estimator's latest."""
    if checkpoint_path is None:
        return model_dir, None
    path = os.path.abspath(str(checkpoint_path))
    base = os.path.basename(path)
    if base.isdigit() and os.path.basename(os.path.dirname(path)) == "checkpoints":
        if not os.path.isdir(path):
            raise ValueError(f"checkpoint_path {checkpoint_path!r} does not exist")
        return os.path.dirname(os.path.dirname(path)), int(base)
    if base == "checkpoints":
        return os.path.dirname(path), None
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return path, None
    raise ValueError(
        f"checkpoint_path {checkpoint_path!r} is not a checkpoint: expected "
        "<model_dir>/checkpoints/<step> or a model_dir"
    )


def _flat_names(tree: Any, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat_names(value, name + "/"))
        else:
            out[name] = value
    return out


def read_variables(path: str) -> dict[str, Any]:
    """Every saved variable of one checkpoint as ``name -> numpy array``.

    ``params`` are named by module path (``dense1/kernel``); other collections keep their
    collection name in front (``batch_stats/BatchNorm_0/mean``); ``global_step`` is the step.
    """
    model_dir, step = resolve_path(path, os.path.dirname(os.path.dirname(path)))
    ckpts = Checkpoints(model_dir, read_only=True)
    step = step if step is not None else ckpts.steps()[-1]
    out = ckpts._manager.restore(
        step, args=ocp.args.Composite(variables=ocp.args.StandardRestore(),
                                      meta=ocp.args.JsonRestore())
    )
    variables = jax.device_get(dict(out["variables"]))
    names = _flat_names(variables.pop("params", {}))
    names.update(_flat_names(variables))
    names["global_step"] = out["meta"]["global_step"]
    return names
