"""What a person watching training sees: a start-up summary and an optional tqdm bar."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

import hooks as hooks_lib

from ..core.compilation import CompileCounter
from ..core.config import RunConfig
from ..engine.options import StepOptions
from ..io import variables as variables_lib
from ..io.variables import PARAMS
from ..parallel import zero

log = logging.getLogger("estimator")


def count_parameters(params: Any) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(params)))


class Startup:
    """The clock (from ``since``, ``time.monotonic()`` when ``train()`` was called) and the
    XLA compile count up to the first step.

    ``close()`` it when training ends; ``StartupSummaryHook`` reads it after the first loop.
    """

    def __init__(self, *, since: float | None = None):
        self.started = time.monotonic() if since is None else since
        self.compiles = CompileCounter().__enter__()
        self.seconds: float | None = None

    def first_step_done(self) -> float:
        """Seconds since ``train()`` was called; stops the compile count."""
        if self.seconds is None:
            self.seconds = time.monotonic() - self.started
            self.close()
        return self.seconds

    def close(self) -> None:
        self.compiles.__exit__(None, None, None)


class StartupSummaryHook(hooks_lib.SessionRunHook):
    """Logs the start-up summary after the first loop (``log_startup_summary``), with the
    time to the first step; the XLA compilations until then at DEBUG. With ``loop_note``
    (``iterations_per_loop="auto"``) the summary waits until it returns the loop's
    description (or training ends)."""

    def __init__(
        self,
        mesh: Mesh,
        config: RunConfig,
        startup: Startup,
        *,
        train_program: Callable[[], Any] | None = None,
        loop_note: Callable[[], str | None] | None = None,
        **fields,
    ):
        self._mesh, self._config, self._startup = mesh, config, startup
        self._loop_note, self._seconds = loop_note, None
        # () -> the compiled train loop, for its memory_analysis() line at DEBUG
        self._train_program = train_program
        # Shapes and shardings only: the arrays themselves are donated to the first loop.
        for key in ("params", "opt_state", "state"):
            fields[key] = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                fields.get(key),
            )
        self._fields = fields
        self._done = False

    def after_run(self, run_context, run_values) -> None:
        if self._done:
            return
        if self._seconds is None:
            self._seconds = self._startup.first_step_done()
        note = None if self._loop_note is None else self._loop_note()
        if self._loop_note is None or note is not None:
            self._log(note)

    def end(self, session) -> None:
        if not self._done and self._seconds is not None:
            self._log(None if self._loop_note is None else self._loop_note())

    def _log(self, loop_note: str | None) -> None:
        self._done = True
        seconds = self._seconds
        log_startup_summary(
            self._mesh, self._config, **self._fields, first_step_secs=seconds, loop_note=loop_note
        )
        c = self._startup.compiles
        log.debug(
            "XLA compilations before the first step: %d compiled, %d loaded from the "
            "persistent cache (%.2f s): %s",
            c.compiled,
            c.cache_hits,
            c.seconds,
            ", ".join(c.names),
        )
        if self._train_program is not None and log.isEnabledFor(logging.DEBUG):
            line = program_memory_line(self._train_program())
            if line is not None:
                log.debug("Train loop memory per device: %s", line)


def _trainer_features(options: StepOptions, replica_batch: int) -> str:
    """The mixed-precision and micro-batch options, where set, for the start-up line."""
    out = ""
    if options.policy.compute_dtype is not None:
        out += f"; compute_dtype {options.policy.compute_dtype} (float32 weights)"
    k = options.num_microbatches
    if k > 1:
        out += f"; num_microbatches {k} ({replica_batch // k} rows each)"
    return out


def log_startup_summary(
    mesh: Mesh,
    config: RunConfig,
    *,
    options: StepOptions,
    global_batch: int,
    replica_batch: int,
    params: Any,
    start_step: int,
    target: int | None,
    opt_state: Any = None,
    state: Any = None,
    first_step_secs: float,
    loop_note: str | None = None,
) -> None:
    """One block: devices, mesh, batch sizes, parameter count, the bytes one device holds of
    the parameters and of the optimizer state, the loop length (``loop_note`` when "auto"
    chose it), the step's compute dtype and micro-batches where set (``options``) and the
    time to the first step; then the parameter table (``parameter_table``) of ``params`` and
    the other collections ``state``."""
    devices = mesh.devices.reshape(-1)
    kinds = sorted({d.device_kind for d in devices})
    log.info(
        "Training on %d %s device(s) (%s), %d process(es); mesh %s; global batch %d, "
        "per-replica batch %d, %d replica(s); %s parameters; per device: parameters %s, "
        "optimizer state %s; iterations_per_loop %s%s; from step %d%s; first step after %.2f s.",
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
        loop_note or config.tpu_config.iterations_per_loop,
        _trainer_features(options, replica_batch),
        start_step,
        "" if target is None else f" to step {target}",
        first_step_secs,
    )
    variables = {PARAMS: params, **dict(state or {})}
    table = parameter_table(variables)
    log.info("%s", table)
    if _CAPPED in table:
        log.debug("%s", parameter_table(variables, max_rows=None))


#: Rows of the start-up parameter table at INFO; the whole table goes to DEBUG beyond it.
MAX_TABLE_ROWS = 40
_CAPPED = "(the whole table at DEBUG level)"


def parameter_table(variables: dict, *, max_rows: int | None = MAX_TABLE_ROWS) -> str:
    """Every variable's name (as ``get_variable_names``), shape, dtype and element count, and
    the totals (trainable ``params``, and the other collections), as Keras's ``summary()``.

    Example:
      >>> print(parameter_table({"params": {"dense": {"kernel": np.zeros((3, 2))}}}))
      Parameters: 1 variable(s), 6 trainable
        name          shape   dtype    count
        dense/kernel  (3, 2)  float64      6
        total                              6
    """
    rows = [
        (name, str(tuple(np.shape(x))), str(getattr(x, "dtype", "")), int(np.prod(np.shape(x))))
        for name, x in variables_lib.flatten(
            {c: variables[c] for c in sorted(variables, key=lambda c: c != PARAMS)}
        ).items()
        if x is not None
    ]
    trainable = count_parameters(variables.get(PARAMS))
    other = sum(r[3] for r in rows) - trainable
    head = f"Parameters: {len(rows)} variable(s), {trainable:,} trainable"
    if other:
        head += f", {other:,} in other collections"
    shown = rows if max_rows is None else rows[:max_rows]
    table = [("name", "shape", "dtype", "count")] + [(n, sh, d, f"{c:,}") for n, sh, d, c in shown]
    table.append(("total", "", "", f"{trainable + other:,}"))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = [head] + [
        f"  {n:<{widths[0]}}  {sh:<{widths[1]}}  {d:<{widths[2]}}  {c:>{widths[3]}}".rstrip()
        for n, sh, d, c in table
    ]
    if len(shown) < len(rows):
        left = rows[len(shown) :]
        lines.insert(
            -1,
            f"  ... {len(left)} more variable(s) ({sum(r[3] for r in left):,} elements) not "
            f"listed {_CAPPED}",
        )
    return "\n".join(lines)


def program_memory(compiled: Any) -> dict[str, int] | None:
    """Bytes per device of a compiled program from XLA's ``memory_analysis()``.

    Keys: ``arguments``, ``outputs``, ``aliased`` (outputs written into donated arguments),
    ``temporaries`` and ``peak`` (arguments + outputs - aliased + temporaries: what the
    program needs on one device at once). A program over several devices is compiled for
    one of them (SPMD), so these are one device's figures, on CPU too, where the simulated
    devices share one process and its RSS is their sum. None where the backend reports no
    analysis.

    Example:
      >>> program_memory(jax.jit(lambda x: x * 2).lower(jnp.ones(256)).compile())["arguments"]
      1024
    """
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if m is None:
        return None
    out = {
        "arguments": int(m.argument_size_in_bytes),
        "outputs": int(m.output_size_in_bytes),
        "aliased": int(m.alias_size_in_bytes),
        "temporaries": int(m.temp_size_in_bytes),
    }
    out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    return out


def program_memory_line(compiled: Any) -> str | None:
    """``program_memory`` for a log line (None without an analysis)."""
    m = program_memory(compiled)
    if m is None:
        return None
    return (
        f"arguments {format_bytes(m['arguments'])}, outputs {format_bytes(m['outputs'])} "
        f"({format_bytes(m['aliased'])} of them in donated arguments), temporaries "
        f"{format_bytes(m['temporaries'])}; peak {format_bytes(m['peak'])} "
        "(XLA memory_analysis, one device)"
    )


def format_bytes(n: int) -> str:
    """``n`` bytes for a person: ``"812 B"``, ``"3.2 KiB"``, ``"1.5 GiB"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def progress_enabled(setting: bool | None) -> bool:
    """``RunConfig.progress_bar`` when set; otherwise on when stderr is a terminal or the
    process is a Jupyter/IPython kernel (tqdm.auto shows its notebook widget there), and
    ``TPU_ESTIMATOR_NO_PROGRESS_BAR`` is not set."""
    if setting is not None:
        return bool(setting)
    if os.environ.get("TPU_ESTIMATOR_NO_PROGRESS_BAR"):
        return False
    return sys.stderr.isatty() or in_notebook()


def in_notebook() -> bool:
    """Whether this process is a Jupyter (or Colab) kernel: tqdm.auto's own test, without
    importing IPython where it was not imported."""
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    try:
        shell = get_ipython() if get_ipython is not None else None
        return shell is not None and "IPKernelApp" in shell.config
    except Exception:  # noqa: BLE001 (a shell without a config: not a kernel)
        return False


def _console_logging(logger: logging.Logger) -> bool:
    return any(
        isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr)
        for h in logger.handlers
    )


class ProgressBarHook(hooks_lib.SessionRunHook):
    """A tqdm bar over global steps, advanced once per loop, showing the loop's mean loss.

    The bar appears when the first loop (which compiles) has run, so its rate and ETA count
    steady-state steps only. While it is shown, console log lines go through ``tqdm.write``
    (``logging_redirect_tqdm``) instead of landing on the bar's line.
    """

    def __init__(self, *, start: int, total: int | None):
        self._start, self._total = start, total
        self._bar = None
        self._redirect = contextlib.ExitStack()

    def before_run(self, run_context):
        return hooks_lib.SessionRunArgs("loss")

    def after_run(self, run_context, run_values) -> None:
        if self._bar is None:
            self._open(self._start + len(run_context.steps))
        else:
            self._bar.update(len(run_context.steps))
        self._bar.set_postfix(loss=f"{float(np.mean(run_values.results)):.4g}")

    def _open(self, done: int) -> None:
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._bar = tqdm(
            total=self._total, initial=done, unit="step", dynamic_ncols=True, leave=False
        )
        loggers = [lg for lg in (logging.root, log) if _console_logging(lg)]
        self._redirect.enter_context(logging_redirect_tqdm(loggers, tqdm_class=type(self._bar)))

    def end(self, session) -> None:
        self._redirect.close()
        if self._bar is not None:
            self._bar.close()
