"""Reading a checkpoint by variable name: every saved value, a Saver's mapping, the averages.

Names are the public ones ``estimator.list_variables`` shows (``io/variables.py``):
``dense1/kernel``, ``batch_stats/BatchNorm_0/mean``, and an ``ExponentialMovingAverage``'s
shadows as ``dense1/kernel/ExponentialMovingAverage``. The storage of whole items, and the
fallback from a damaged step, are ``Checkpoints``' (``io/checkpoint.py``); which read a
restore needs is decided by its caller (``io/restore.py``).

Example:
  >>> read_variables("/runs/a")["dense1/kernel"].shape  # the newest readable checkpoint
  (784, 128)
  >>> variables = restore_mapped(ckpts, step, template, {"dense/kernel": "ema/kernel"})
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from .. import storage
from ..core.errors import CheckpointError, CheckpointMismatchError, NoCheckpointError
from . import variables as variables_lib
from .checkpoint import MAX_LISTED, Checkpoints, short_error
from .model_dir import resolve_path

log = logging.getLogger("estimator")

_READ: dict = {}  # the last checkpoint read_variables read: its directory's stamp, its names
_READ_LOCK = threading.Lock()
_LOGGED_UNREAD: set[tuple] = set()


def read_variables(path: str) -> dict[str, Any]:
    """Every saved variable of one checkpoint as ``name -> numpy array``.

    ``path`` is a step directory or a model_dir (its newest readable checkpoint). ``params``
    are named by module path (``dense1/kernel``); other collections keep their collection
    name in front (``batch_stats/BatchNorm_0/mean``); an ``ExponentialMovingAverage``'s
    shadows are ``dense1/kernel/ExponentialMovingAverage``; ``global_step`` is the step.

    The arrays are read-only and shared: the last checkpoint read is kept (``_READ``) until
    another is asked for or its directory changes, so reading a ResNet's 100 variables one
    by one (``get_variable_value``, ``load_variable``) reads it once, not 100 times.

    Raises:
      NoCheckpointError: there is no checkpoint at ``path``.
      CheckpointError: none is readable.
    """
    model_dir, step = resolve_path(path, storage.dirname(storage.dirname(path)))
    ckpts = Checkpoints(model_dir, read_only=True)
    wanted = step if step is not None else ckpts.newest_step()
    # a checkpoint rewritten at the same step (a new run in the same model_dir) is a new
    # directory, with another stamp
    stamp = storage.stamp(ckpts.path(wanted)) if wanted is not None else None
    with _READ_LOCK:
        if stamp is not None and _READ.get("stamp") == stamp:
            return dict(_READ["names"])
    got = ckpts.restore_latest(step=step)
    if got is None:
        raise NoCheckpointError(f"No checkpoint found in {model_dir}")
    step, out = got
    names = named_values(ckpts, step, out)
    names["global_step"] = out["meta"]["global_step"]
    for value in names.values():
        if isinstance(value, np.ndarray):
            value.setflags(write=False)  # shared by every later read of this checkpoint
    if step == wanted and stamp is not None:  # not a fallback from a damaged newest step
        with _READ_LOCK:
            _READ.clear()
            _READ.update(stamp=stamp, names=names)
    return dict(names)


def named_values(
    ckpts: Checkpoints, step: int, restored: dict | None = None
) -> dict[str, np.ndarray]:
    """Every saved variable of one step on the host, by its public name (the names
    ``estimator.list_variables`` shows, ``global_step`` aside; moving averages included).
    ``restored``: what ``ckpts.restore(step)`` already returned (not read again)."""
    out = restored if restored is not None else ckpts.restore(step)
    names = variables_lib.flatten(jax.device_get(dict(out["variables"])))
    names.update(moving_averages(ckpts, step))  # <var>/ExponentialMovingAverage
    return names


def restore_mapped(
    ckpts: Checkpoints, step: int, template: Any, sources: dict[str, str] | None = None
) -> dict:
    """The model's variables (``template``'s structure, dtypes and shardings) read by
    name: each from ``sources.get(name, name)``. Checkpoint variables nothing reads are
    left out and named once in the log (TF's Saver restores what it is asked for).

    Raises:
      CheckpointMismatchError: a variable's checkpoint name is missing or its shape
        differs (every difference named).
    """
    sources = sources or {}
    wanted = variables_lib.flatten(template)
    unknown = sorted(set(sources) - set(wanted))
    if unknown:
        raise CheckpointMismatchError(
            f"Saver var_list names variable(s) the model does not have: {unknown[:MAX_LISTED]}"
            f"; the model's are {sorted(wanted)[:MAX_LISTED]}"
        )
    saved = named_values(ckpts, step)
    values, problems = {}, []
    for name, spec in wanted.items():
        src = sources.get(name, name)
        label = name if src == name else f"{name} (from checkpoint name {src!r})"
        if src not in saved:
            problems.append(f"{label}: in the model {tuple(spec.shape)}, not in the checkpoint")
        elif tuple(np.shape(saved[src])) != tuple(spec.shape):
            problems.append(
                f"{label}: checkpoint shape {np.shape(saved[src])}, model shape {spec.shape}"
            )
        else:
            values[name] = _placed(np.asarray(saved[src]), spec)
    if problems:
        more = len(problems) - MAX_LISTED
        raise CheckpointMismatchError(
            f"checkpoint {ckpts.path(step)} does not match the model ({len(problems)} "
            f"difference(s)): {'; '.join(problems[:MAX_LISTED])}"
            f"{f'; and {more} more' if more > 0 else ''}. It was written by a different "
            "model_fn or params (checkpoint variables the model lacks are left out; each "
            "model variable must be there, or be mapped by a Saver's var_list); use a new "
            "model_dir, or warm_start_from to load matching variables."
        )
    _log_unread(ckpts.path(step), sorted(set(saved) - set(sources.get(n, n) for n in wanted)))
    return variables_lib.unflatten_into(template, values)


def _placed(value: np.ndarray, spec: Any) -> Any:
    """``value`` as the template leaf wants it: its dtype, on its sharding when it has one
    (each process places only its own shards, so this works across hosts)."""
    value = value.astype(spec.dtype, copy=False)
    sharding = getattr(spec, "sharding", None)
    if sharding is None:
        return value
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _log_unread(path: str, names: list[str]) -> None:
    """Names, once per checkpoint directory and set of names, the checkpoint variables a
    mapped restore left unread (an EMA run's averages evaluated with EMA off, say)."""
    key = (storage.dirname(path), tuple(names))
    if names and key not in _LOGGED_UNREAD:
        _LOGGED_UNREAD.add(key)
        log.info(
            "Checkpoint %s holds %d variable(s) the model does not read (left out): %s",
            path,
            len(names),
            names[:MAX_LISTED] + (["..."] if len(names) > MAX_LISTED else []),
        )


# ----------------------------------------------------------------- moving averages
def moving_average_shapes(ckpts: Checkpoints, step: int) -> dict[str, tuple]:
    """``{"<var>/ExponentialMovingAverage": shape}`` of the step's moving averages (read
    from the metadata of its optimizer state; see ``variables.moving_average_names``)."""
    named = variables_lib.moving_average_names(ckpts.item_metadata(step, "train"))
    return {n: tuple(m.shape) for n, m in named.items()}


def moving_averages(ckpts: Checkpoints, step: int) -> dict[str, np.ndarray]:
    """The step's moving averages as numpy arrays, named as ``moving_average_shapes``
    (empty without an ``ExponentialMovingAverage`` in the train_op)."""
    part = _moving_average_part(ckpts, step)
    return {} if part is None else variables_lib.moving_average_names(part)


def moving_average_for_eval(ckpts: Checkpoints, step: int) -> dict[str, np.ndarray] | None:
    """``{param name: shadow}`` of an ``ExponentialMovingAverage(use_for_eval=True)``
    saved in the step, or None (no moving average, or one not meant for evaluation)."""
    part = _moving_average_part(ckpts, step)
    return None if part is None else variables_lib.moving_average_for_eval(part)


def _moving_average_part(ckpts: Checkpoints, step: int) -> Any:
    """The moving averages (and their flags) of the step's optimizer state as numpy,
    read without the rest of it where the tree allows; None when there are none."""
    saved = ckpts.item_metadata(step, "train")
    if not variables_lib.moving_average_names(saved):
        return None
    try:
        template = _moving_average_template(saved)
        if template is None:  # inside a sequence (a chain): read the whole item
            return ckpts.host_item(step, "train")
        handler = ocp.PyTreeCheckpointHandler()
        try:
            host = ocp.RestoreArgs(restore_type=np.ndarray)
            restore_args = jax.tree.map(lambda _: host, template)
            args = ocp.args.PyTreeRestore(template, restore_args=restore_args, partial_restore=True)
            return handler.restore(epath.Path(ckpts.path(step)) / "train", args=args)
        finally:
            handler.close()
    except Exception as e:  # noqa: BLE001 - Orbax raises many types; we name the step
        raise CheckpointError(
            f"checkpoint {ckpts.path(step)}: its moving averages could not be read "
            f"({short_error(e)})"
        ) from e


def _moving_average_template(saved: Any) -> Any:
    """Host arrays shaped like the moving-average parts of a saved ``train`` tree (the
    ``ExponentialMovingAverage`` and ``use_for_eval`` entries, in their dicts), for a
    partial restore; None when one of them sits inside a sequence (no partial template)."""
    keep = (variables_lib.MOVING_AVERAGE, variables_lib.EVAL_FLAG)

    def prune(node: Any) -> Any:
        if isinstance(node, dict):
            out = {}
            for key, value in node.items():
                if key in keep:
                    out[key] = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), value)
                else:
                    sub = prune(value)
                    if sub:
                        out[key] = sub
            return out
        if isinstance(node, (list, tuple)) and any(prune(v) for v in node):
            raise LookupError
        return {}

    try:
        return prune(saved)
    except LookupError:
        return None
