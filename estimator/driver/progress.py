"""What a person watching training sees: a start-up summary and an optional tqdm bar."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

import hooks as hooks_lib

from ..config import RunConfig
from ..parallel import zero

log = logging.getLogger("estimator")


def count_parameters(params: Any) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(params)))


def log_startup_summary(
    mesh: Mesh,
    config: RunConfig,
    *,
    global_batch: int,
    replica_batch: int,
    params: Any,
    start_step: int,
    target: int | None,
    opt_state: Any = None,
) -> None:
    """One block at the start of training: devices, mesh, batch sizes, parameter count and
    the bytes one device holds of the parameters and of the optimizer state."""
    devices = mesh.devices.reshape(-1)
    kinds = sorted({d.device_kind for d in devices})
    log.info(
        "Training on %d %s device(s) (%s), %d process(es); mesh %s; global batch %d, "
        "per-replica batch %d, %d replica(s); %s parameters; per device: parameters %s, "
        "optimizer state %s; iterations_per_loop %d; from step %d%s.",
        len(devices),
        devices[0].platform,
        ", ".join(kinds),
        jax.process_count(),
        dict(mesh.shape),
        global_batch,
        replica_batch,
        mesh.shape["data"],
        f"{count_parameters(params):,}",
        format_bytes(zero.bytes_per_device(params)),
        format_bytes(zero.bytes_per_device(opt_state)),
        config.tpu_config.iterations_per_loop,
        start_step,
        "" if target is None else f" to step {target}",
    )


def format_bytes(n: int) -> str:
    """``n`` bytes for a person: ``"812 B"``, ``"3.2 KiB"``, ``"1.5 GiB"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def progress_enabled(setting: bool | None) -> bool:
    """``RunConfig.progress_bar`` when set; otherwise on when stderr is a terminal and
    ``TPU_ESTIMATOR_NO_PROGRESS_BAR`` is not set."""
    if setting is not None:
        return bool(setting)
    return sys.stderr.isatty() and not os.environ.get("TPU_ESTIMATOR_NO_PROGRESS_BAR")


class ProgressBarHook(hooks_lib.SessionRunHook):
    """A tqdm bar over global steps, advanced once per loop, showing the loop's mean loss."""

    def __init__(self, *, start: int, total: int | None):
        self._start, self._total = start, total
        self._bar = None

    def begin(self) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=self._total, initial=self._start, unit="step", dynamic_ncols=True, leave=False
        )

    def before_run(self, run_context):
        return hooks_lib.SessionRunArgs("loss")

    def after_run(self, run_context, run_values) -> None:
        self._bar.update(len(run_context.steps))
        self._bar.set_postfix(loss=f"{float(np.mean(run_values.results)):.4g}")

    def end(self, session) -> None:
        self._bar.close()
