"""Goodput across restarts: ``goodput.json`` in model_dir, and the report at the end of ``train``.

Process 0 keeps ``<model_dir>/goodput.json``: the job's totals up to now
(``goodput.Goodput.totals``), the step reached, and the totals at each recent checkpoint
(``"checkpoints"``, the newest ``KEPT_CHECKPOINTS``). It is written at each checkpoint, every
``goodput.WRITE_EVERY_SECS`` at a loop's end, and when ``train`` ends (also when it fails).
The next run starts from the totals at the checkpoint it restores; when the record says the
previous run went on past that checkpoint, the wall time it spent after it counts as
``lost`` (its steps are redone), and its other parts stay as they were at the checkpoint.

The totals are not in the checkpoint's own meta: two runs of the same job write the same
checkpoint files, bit for bit (``training_resume_test``), and wall-clock times would differ.
A model_dir without the record (or a checkpoint it does not list) starts from zero.

Example:
  >>> gp = goodput.Goodput(model_dir="/runs/a")
  >>> resume(gp, "/runs/a", meta={"global_step": 100})   # the restored checkpoint's meta
  >>> with goodput.active(gp):
  ...     ...                                   # train; saved(step) after each checkpoint
  >>> report(gp, writer, step=200)              # one INFO line, goodput/* scalars
"""

from __future__ import annotations

import json
import logging
from typing import Any

from hooks import SessionRunContext, SessionRunHook, SessionRunValues

from .. import storage
from ..parallel import multihost
from . import goodput
from .goodput import PARTS, Goodput

log = logging.getLogger("estimator")

TAGS = ("wall_s", *(f"{p}_s" for p in PARTS), "fraction")
KEPT_CHECKPOINTS = 64  # the totals at the newest checkpoints (more than keep_checkpoint_max)


def _totals(raw: Any) -> dict[str, float] | None:
    """A totals dict read from JSON, or None when it is not one."""
    if not isinstance(raw, dict):
        return None
    try:
        out = {k: float(raw.get(k, 0.0)) for k in ("wall_s", *(f"{p}_s" for p in PARTS))}
    except (TypeError, ValueError):
        return None
    return out if all(v >= 0 for v in out.values()) else None


def _read_file(model_dir: str) -> dict | None:
    path = storage.join(model_dir, goodput.FILE)
    try:
        if not storage.exists(path):
            return None
        data = json.loads(storage.read_text(path))
    except (OSError, ValueError) as e:
        log.debug("goodput: %s not read (%s)", path, e)
        return None
    return data if isinstance(data, dict) else None


def resume(gp: Goodput, model_dir: str, meta: dict) -> None:
    """Starts ``gp`` from the totals at the checkpoint ``meta`` describes (empty: a fresh
    start, step 0), plus what the previous run lost after it."""
    step = int(meta.get("global_step", 0) or 0)
    kept = _read_file(model_dir) or {}
    checkpoints = kept.get("checkpoints") if isinstance(kept.get("checkpoints"), dict) else {}
    at, upto = _totals(checkpoints.get(str(step))), _totals(kept.get("totals"))
    reached = kept.get("step")
    base = at or goodput.zero_totals()
    if upto is not None and reached == step and kept.get("checkpoint_step") == step:
        base = upto  # it ended at that checkpoint: every part counted as it was
    elif at is not None and upto is not None and upto["wall_s"] >= at["wall_s"]:
        lost = upto["wall_s"] - at["wall_s"]
        base = {**at, "wall_s": upto["wall_s"], "lost_s": at["lost_s"] + lost}
        log.info(
            "Goodput: the previous run reached step %s after the checkpoint at step %d; its "
            "%.2f s since that checkpoint count as lost.",
            reached,
            step,
            lost,
        )
    gp.base, gp.base_step = base, step
    gp.checkpoints = {k: v for k, v in checkpoints.items() if _totals(v) is not None}
    gp.checkpoints[str(step)] = dict(base)
    gp.checkpoint_step = step


def saved(step: int) -> None:
    """Records a checkpoint of ``step`` just written: the totals at it, in ``goodput.json``
    (nothing outside an active ``Goodput``)."""
    gp = goodput.current()
    if gp is None or gp.base_step is None or gp.checkpoint_step == step:
        return
    gp.checkpoints[str(step)] = {k: v for k, v in gp.totals().items() if k != "fraction"}
    for old in sorted(gp.checkpoints, key=int)[:-KEPT_CHECKPOINTS]:
        del gp.checkpoints[old]
    gp.checkpoint_step = step
    write(gp, step)


def write(gp: Goodput, step: int) -> None:
    """``goodput.json``: the totals up to now, the step reached and the checkpoints' totals."""
    gp.last_written = gp.now()
    if gp.base_step is None or gp.model_dir is None or not multihost.is_process_0():
        return  # a call that never started training has nothing to add
    record = {
        "step": int(step),
        "checkpoint_step": gp.checkpoint_step,
        "totals": _rounded(gp.totals()),
        "checkpoints": {k: _rounded(v) for k, v in gp.checkpoints.items()},
    }
    path = storage.join(gp.model_dir, goodput.FILE)
    try:
        storage.write_bytes(path + ".tmp", json.dumps(record, sort_keys=True).encode())
        storage.rename(path + ".tmp", path)
    except OSError as e:  # the record is a report: a failed write never stops training
        log.debug("goodput: %s not written (%s)", path, e)


def _rounded(totals: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 6) for k, v in totals.items()}


class GoodputHook(SessionRunHook):
    """Rewrites ``goodput.json`` after a loop when ``goodput.WRITE_EVERY_SECS`` passed since
    the last write, so a run that dies between checkpoints leaves where it got to."""

    def __init__(self, gp: Goodput):
        self._gp = gp

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        gp = self._gp
        if len(run_context.steps) and gp.now() - gp.last_written >= goodput.WRITE_EVERY_SECS:
            write(gp, int(run_context.steps[-1]))


def report(gp: Goodput, writer: Any, step: int) -> dict[str, float]:
    """One INFO line and the ``goodput/`` scalars (the model_dir's totals) at ``step``."""
    t = gp.totals()
    call = gp.call_totals()
    log.info(
        "Goodput: %.1f%% of %.2f s productive (this call %.2f s of %.2f s); compile %.2f s, "
        "input wait %.2f s, checkpoint %.2f s, host %.2f s, lost to restarts %.2f s.",
        100 * t["fraction"],
        t["wall_s"],
        call["productive_s"],
        call["wall_s"],
        t["compile_s"],
        t["input_wait_s"],
        t["checkpoint_s"],
        t["host_s"],
        t["lost_s"],
    )
    if writer is not None and multihost.is_process_0():
        for tag in TAGS:
            writer.add_scalar(f"goodput/{tag}", t[tag], global_step=step)
    return t


__all__ = ["KEPT_CHECKPOINTS", "TAGS", "GoodputHook", "report", "resume", "saved", "write"]
