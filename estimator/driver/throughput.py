"""Throughput, FLOP/s and MFU per device, with no user code: read from the compiled train loop.

The model FLOPs of one global step come from XLA's cost analysis of the train loop the run
already compiled (``compiled.cost_analysis()``; nothing is compiled for it), and the speed
from the loop boundaries the estimator already times. Three figures follow per device:
examples/s, TFLOP/s and, where the device's peak is known (``PEAK_TFLOPS``, by
``device_kind``), the model FLOPs utilisation (MFU). They are logged beside the
``examples/sec`` progress line (``PerfStepCounterHook``), written to TensorBoard every
``save_summary_steps`` (``PerfSummaryHook``) and summed up in one line at the end of ``train``.

What XLA's cost analysis reports, measured on jax 0.10.2 (``tests/estimator/driver/
throughput_test.py``):

* a ``shard_map`` or GSPMD program is analysed as the program of **one device**: its
  ``flops`` are one device's share, so the global step is that times the devices;
* a rolled loop (a ``while``) is counted **once**, whatever its trip count, while an
  unrolled one is counted step by step. So the loop's flops are one step's when the train
  loop is rolled, and ``steps`` steps' when it is unrolled. Loops inside the step (the
  micro-batch accumulation, a ``nn.scan`` over layers) are counted once too: there the
  figure is a lower bound, and one INFO line says so.

Example:
  >>> flops = ModelFlops(lambda: compiled, steps=25, unrolled=False, devices=8,
  ...                    device_kind="TPU v4")        # compiled: the train loop's executable
  >>> flops.per_step                                   # cost analysis flops x 8 devices
  >>> flops.figures(steps_per_sec=10.0, examples_per_step=256)   # the perf/ scalars
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import hooks as hooks_lib
from hooks import SessionRunContext, SessionRunHook, SessionRunValues

from ..core.spec import ModeKeys

log = logging.getLogger("estimator")

# Peak dense bf16 TFLOP/s of one device (a TPU chip's, a GPU's), by a lowercase part of
# ``jax.devices()[0].device_kind``; the first match wins, so the more specific comes first.
# From the vendors' data sheets (dense, no sparsity).
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("tpu v6 lite", 918.0),  # v6e (Trillium)
    ("tpu v6e", 918.0),
    ("tpu v5 lite", 197.0),  # v5e
    ("tpu v5e", 197.0),
    ("tpu v5p", 459.0),
    ("tpu v5", 459.0),  # v5p reports "TPU v5"
    ("tpu v4", 275.0),
    ("h200", 989.0),  # H200 SXM (and GH200)
    ("h100 pcie", 756.0),
    ("h100", 989.0),  # H100 SXM
    ("a100", 312.0),
)

TAGS = (
    "perf/examples_per_sec_per_device",
    "perf/tflops_per_device",
    "perf/mfu",
    "perf/model_flops_per_step",
)


def peak_flops(device_kind: str) -> float | None:
    """A device's peak dense bf16 FLOP/s from ``PEAK_TFLOPS``; None when unknown (CPU).

    Example:
      >>> peak_flops("TPU v5 lite"), peak_flops("NVIDIA H100 80GB HBM3"), peak_flops("cpu")
      (197000000000000.0, 989000000000000.0, None)
    """
    kind = device_kind.lower()
    for part, tflops in PEAK_TFLOPS:
        if part in kind:
            return tflops * 1e12
    return None


def loop_flops(compiled: Any) -> float | None:
    """``flops`` of a compiled program's cost analysis (one device's), or None."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without an analysis
        return None
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    flops = float((analysis or {}).get("flops", 0.0) or 0.0)
    return flops if flops > 0 else None


_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_BODY = re.compile(r" while\(.*\bbody=%([\w.\-]+)")
_MATH = (" dot(", " convolution(")


def inner_loops(compiled: Any, *, unrolled: bool) -> int:
    """How many ``while`` loops doing matrix math the program holds besides the train loop.

    Only loops whose body (or a computation it calls) holds a ``dot`` or ``convolution``
    count: the random-bit generator's loops and the like add no model FLOPs.
    """
    try:
        text = compiled.as_text()
    except Exception:  # noqa: BLE001
        return 0
    computations: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in text.splitlines():
        start = _COMPUTATION.match(line)
        if start:
            lines = computations.setdefault(start.group(1), [])
        lines.append(line)
    bodies = [m.group(1) for m in _BODY.finditer(text)]
    math = sum(_does_math(b, computations, set()) for b in bodies)
    return max(0, math - (0 if unrolled else 1))


def _does_math(name: str, computations: dict[str, list[str]], seen: set[str]) -> bool:
    if name in seen or name not in computations:
        return False
    seen.add(name)
    body = "\n".join(computations[name])
    if any(op in body for op in _MATH):
        return True
    called = re.findall(r"%([\w.\-]+)", body)
    return any(_does_math(c, computations, seen) for c in called if c in computations)


class ModelFlops:
    """The model FLOPs of one global train step, read once from the compiled loop.

    Args:
      compiled: () -> the compiled train loop (from the programs the run already has).
      steps: the steps of that compiled call.
      unrolled: whether its loop is unrolled (XLA counts each step) or rolled (counted once).
      devices: the devices of the mesh (cost analysis is one device's).
      device_kind: ``device_kind`` of the devices, for the peak.
    """

    def __init__(
        self,
        compiled: Callable[[], Any] | None,
        *,
        steps: int,
        unrolled: bool,
        devices: int,
        device_kind: str,
    ):
        self._compiled, self._steps, self._unrolled = compiled, steps, unrolled
        self.devices = devices
        self.device_kind = device_kind
        self.peak = peak_flops(device_kind)
        self._value: float | None = None
        self._read = False

    @classmethod
    def of(cls, job: Any, compiled: Callable[[], Any] | None, *, steps: int) -> ModelFlops:
        """The ``ModelFlops`` of a ``train`` call of ``job`` whose first call runs ``steps``."""
        devices = job.mesh.devices.reshape(-1)
        return cls(
            compiled,
            steps=steps,
            unrolled=job.programs.unrolled(ModeKeys.TRAIN),
            devices=len(devices),
            device_kind=devices[0].device_kind,
        )

    @property
    def per_step(self) -> float | None:
        """Global model FLOPs of one step (all replicas), or None when XLA reports none."""
        if not self._read:
            self._read = True
            self._value = self._analyse()
        return self._value

    def _analyse(self) -> float | None:
        if self._compiled is None:
            return None
        try:
            compiled = self._compiled()
        except Exception as e:  # noqa: BLE001 - reporting never stops training
            log.debug("No model FLOPs: the train loop could not be read (%s)", e)
            return None
        flops = loop_flops(compiled)
        if flops is None:
            return None
        per_device = flops / (self._steps if self._unrolled else 1)
        inner = inner_loops(compiled, unrolled=self._unrolled)
        if inner:
            log.info(
                "Model FLOPs per step are a lower bound: XLA's cost analysis counts each of the "
                "%d loop(s) inside the train step (micro-batches, scanned layers) once.",
                inner,
            )
        return per_device * self.devices

    def figures(self, *, steps_per_sec: float, examples_per_step: int) -> dict[str, float]:
        """The ``perf/`` scalars at a measured speed (``perf/mfu`` only with a known peak;
        the FLOP figures only when XLA reported FLOPs)."""
        out = {TAGS[0]: steps_per_sec * examples_per_step / self.devices}
        flops = self.per_step
        if flops is not None:
            per_device = flops * steps_per_sec / self.devices
            out[TAGS[1]] = per_device / 1e12
            if self.peak:
                out[TAGS[2]] = per_device / self.peak
            out[TAGS[3]] = flops
        return out

    def line(self, *, steps_per_sec: float, examples_per_step: int) -> str:
        """The figures for a log line: ``per device: 1,000 examples/sec, 0.25 TFLOP/s, ...``."""
        got = self.figures(steps_per_sec=steps_per_sec, examples_per_step=examples_per_step)
        out = f"per device: {got[TAGS[0]]:,.4g} examples/sec"
        if TAGS[1] in got:
            out += f", {got[TAGS[1]]:.4g} TFLOP/s"
            if TAGS[2] in got:
                out += f", MFU {100 * got[TAGS[2]]:.1f}% of {self.peak / 1e12:g} TFLOP/s bf16"
            else:
                out += f" (MFU: no known peak for {self.device_kind})"
            out += f"; model FLOPs per step {got[TAGS[3]]:.4g} (XLA cost analysis)"
        return out


class PerfStepCounterHook(hooks_lib.StepCounterHook):
    """``StepCounterHook`` whose progress lines are followed by the per-device figures, at
    the same speed (``global_step/sec: X``, ``examples/sec: Y``, then ``per device: ...``)."""

    def __init__(self, *args, flops: ModelFlops, **kwargs):
        super().__init__(*args, **kwargs)
        self._flops = flops

    def _report(self, step: int, steps_per_sec: float, examples_per_step: int) -> None:
        super()._report(step, steps_per_sec, examples_per_step)
        if examples_per_step and log.isEnabledFor(logging.INFO):
            log.info(
                "%s",
                self._flops.line(steps_per_sec=steps_per_sec, examples_per_step=examples_per_step),
            )


class PerfSummaryHook(SessionRunHook):
    """Writes the ``perf/`` scalars every ``every`` steps (at the last step of each loop
    that crossed a multiple, measured since the previous report, as ``examples/sec``), and
    at ``end`` logs the call's figures over its loops after the first (which compiles) and
    writes them at the last step when that step had none.

    Args:
      writer: a tensorboardX writer, or None (no scalars).
      every: ``RunConfig.save_summary_steps`` (0: no scalars).
      flops: the ``ModelFlops`` of the run.
      examples_per_step: the global batch.
      clock: seconds, monotonic (for tests).
    """

    def __init__(
        self,
        writer: Any,
        *,
        every: int | None,
        flops: ModelFlops,
        examples_per_step: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._writer, self._every, self._flops = writer, every or 0, flops
        self._examples = examples_per_step
        self._clock = clock
        self._first: tuple[int, float] | None = None  # (step, time) at the first loop's end
        self._report: tuple[int, float] | None = None  # at the previous report
        self._last: tuple[int, float] | None = None  # at the latest loop's end
        self._written = -1  # the last step written

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        steps = np.asarray(run_context.steps).reshape(-1)
        if not len(steps):
            return
        now, end = self._clock(), int(steps[-1])
        self._last = (end, now)
        if self._first is None:  # the first loop compiles: it only starts the clocks
            self._first = self._report = (end, now)
            return
        due = self._every and any(int(s) % self._every == 0 for s in steps)
        if due and self._writer is not None:
            rate = _rate(self._report, self._last)
            if rate is not None:
                self._write(end, rate)
                self._report = self._last

    def end(self, session: Any) -> None:
        rate = _rate(self._first, self._last)
        if rate is None:
            return
        first, last = self._first[0], self._last[0]
        if log.isEnabledFor(logging.INFO):
            line = self._flops.line(steps_per_sec=rate, examples_per_step=self._examples)
            log.info("Throughput over steps %d-%d: %s.", first + 1, last, line)
        if self._writer is not None and self._every and self._written != last:
            self._write(last, rate)

    def _write(self, step: int, steps_per_sec: float) -> None:
        got = self._flops.figures(steps_per_sec=steps_per_sec, examples_per_step=self._examples)
        for tag, value in got.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._written = step


def _rate(since: tuple[int, float] | None, until: tuple[int, float] | None) -> float | None:
    """Steps per second between two ``(step, time)`` marks; None without steps or time."""
    if since is None or until is None:
        return None
    steps, secs = until[0] - since[0], until[1] - since[1]
    return steps / secs if steps > 0 and secs > 0 else None


__all__ = [
    "PEAK_TFLOPS",
    "TAGS",
    "ModelFlops",
    "PerfStepCounterHook",
    "PerfSummaryHook",
    "inner_loops",
    "loop_flops",
    "peak_flops",
]
