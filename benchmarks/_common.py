"""Shared benchmark helpers: interleaved timing, medians of ratios, memory, compiles, tables.

Timing: every case is warmed up (compiled) first, then the cases run interleaved, ``A, B, C,
A, B, C, ...``, and each ratio is taken within one repeat (neighbours in time see the same
machine load) before the median over repeats is reported.

Memory: a case's peak is measured in a fresh Python process (``--probe CASE``), as the growth
of the peak resident set size (``resource.getrusage``) over the resident size just before the
case starts (after imports, the numpy data and device start-up). On devices that report
``memory_stats()`` (GPU, TPU) the device's ``peak_bytes_in_use`` is reported instead; on CPU
it is ``None`` and host RSS is what is used.

Example:
  >>> times = interleave({"a": run_a, "b": run_b}, repeats=5)
  >>> median_ratio(times["a"], times["b"])     # median over repeats of a's time / b's time
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax

import hooks

_KIB = 1024.0
_MIB = 1024.0 * 1024.0
PROBE_PREFIX = "PROBE_RESULT "


# ----------------------------------------------------------------------------- timing
now = time.perf_counter


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes; ``fn`` must block until its device work is done."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleave_settings(settings, cases, data, *, repeats: int, prefix: str) -> list:
    """``[(setting, interleave(cases(setting, data, tmp)))]`` for each setting, the runs'
    model_dirs under one temporary folder removed afterwards."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    try:
        return [(s, interleave(cases(s, data, tmp), repeats=repeats)) for s in settings]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def interleave(cases: dict[str, Callable[[], float]], *, repeats: int) -> dict[str, list[float]]:
    """Runs every case once per repeat, in order, ``repeats`` times; each returns seconds.

    Returns:
      ``{name: [seconds of repeat 0, repeat 1, ...]}``.
    """
    out: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, run in cases.items():
            out[name].append(run())
    return out


def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """The median over repeats of ``numerator[r] / denominator[r]``."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(
            f"need equal, non-empty repeats, got {len(numerator)} and {len(denominator)}"
        )
    return statistics.median(n / d for n, d in zip(numerator, denominator, strict=True))


def throughput(examples: int, seconds: Sequence[float]) -> float:
    """Examples per second at the median time."""
    return examples / statistics.median(seconds)


class Timing(NamedTuple):
    """One timed run: its wall time and its steady-state seconds per step.

    ``per_step`` is measured between the ends of the first and the last loop of the run, so
    it leaves out the one-off start (first dispatch, input start-up) and end (the estimator's
    final checkpoint) that ``wall`` includes.
    """

    wall: float
    per_step: float
    compiles: int = 0  # XLA compilations during the run


def warm_up(est: Any, input_fn: Callable, iterations_per_loop: int) -> None:
    """Compiles everything a later ``train`` call runs: two loops, not one.

    The first loop runs on the freshly initialised state and the second on the state the
    loop returned; when their shardings differ (see the README, Performance) the loop compiles
    again at the second loop, which a one-loop warm-up would leave to the first timed run.
    """
    est.train(input_fn, steps=2 * iterations_per_loop)


def timed_train(est: Any, input_fn: Callable, steps: int) -> Timing:
    """``est.train(input_fn, steps=steps)``: wall, steady-state per step and compiles."""
    timer = LoopTimer()
    with CompileCounter().active() as counter:
        wall = timed(lambda: est.train(input_fn, steps=steps, hooks=[timer]))
    return Timing(wall, timer.per_step(), counter.compiled)


def steady_per_step(stamps: Sequence[float], steps_between: int) -> float:
    """Seconds per step between the first and last of ``stamps`` (``steps_between`` steps)."""
    if len(stamps) < 2 or steps_between <= 0:
        raise ValueError(
            f"need two loop-end stamps over > 0 steps, got {len(stamps)} stamps "
            f"over {steps_between} steps (run at least two loops)"
        )
    return (stamps[-1] - stamps[0]) / steps_between


class LoopTimer(hooks.SessionRunHook):
    """A hook stamping the end of every device loop (``after_run``) with its last step."""

    def __init__(self):
        self.stamps: list[float] = []
        self.steps: list[int] = []

    def before_run(self, run_context):
        return hooks.SessionRunArgs("global_step")

    def after_run(self, run_context, run_values) -> None:
        self.stamps.append(time.perf_counter())
        self.steps.append(int(run_values.results[-1]))

    def per_step(self) -> float:
        """Steady-state seconds per step between the first and the last loop."""
        return steady_per_step(self.stamps, self.steps[-1] - self.steps[0])


# ----------------------------------------------------------------------------- memory
def rss_mib() -> float:
    """The resident set size of this process now, in MiB (Linux; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / _MIB
    except (OSError, ValueError, IndexError):
        return peak_rss_mib()


def peak_rss_mib() -> float:
    """The peak resident set size of this process so far, in MiB.

    On Linux this is ``VmHWM`` from ``/proc/self/status``: ``getrusage``'s ``ru_maxrss`` is
    inherited across fork and exec, so a probe started by a large benchmark process would
    report its parent's peak. Elsewhere ``resource.getrusage`` is used.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / _KIB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / _MIB if sys.platform == "darwin" else peak / _KIB  # bytes on macOS


def device_peak_mib() -> float | None:
    """Peak bytes in use on device 0 where the backend reports it (not on CPU)."""
    stats = jax.devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["peak_bytes_in_use"] / _MIB


class MemoryProbe:
    """Peak memory of what runs between ``start()`` and ``result()``, in a fresh process."""

    def start(self) -> None:
        jax.devices()  # start the backend before the baseline
        self.baseline = rss_mib()
        self.device_baseline = device_peak_mib()

    def result(self) -> dict[str, Any]:
        device = device_peak_mib()
        if device is not None:
            return {"peak_mib": device, "source": "device peak_bytes_in_use"}
        return {"peak_mib": peak_rss_mib() - self.baseline, "source": "host peak RSS growth"}


def run_probe(module: str, case: str, argv: Sequence[str] = ()) -> dict[str, Any]:
    """Runs ``python -m <module> --probe <case> <argv>`` and returns the JSON it printed.

    Raises:
      RuntimeError: the probe process failed (its stderr's tail is in the message).
    """
    cmd = [sys.executable, "-m", module, "--probe", case, *argv]
    env = os.environ.copy()
    if jax.config.read("jax_disable_most_optimizations"):  # a smoke run: probes do the same
        env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=_repo_root(), timeout=600
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(PROBE_PREFIX):
            return json.loads(line[len(PROBE_PREFIX) :])
    raise RuntimeError(
        f"probe {case!r} of {module} failed (exit {proc.returncode}): {proc.stderr[-2000:]}"
    )


def probe_all(module: str, keys: Sequence[str], *, quick: bool, skip: bool) -> dict[str, float]:
    """``{key: peak MiB}`` of every probed case, each in a fresh process (``{}`` if skip)."""
    if skip:
        return {}
    argv = ["--quick"] if quick else []
    return {k: run_probe(module, k, argv)["peak_mib"] for k in keys}


def print_probe_result(result: dict[str, Any]) -> None:
    print(PROBE_PREFIX + json.dumps(result), flush=True)


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- compiles
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts XLA compilations (``/jax/core/compile/backend_compile_duration`` events) and
    persistent-cache hits while active. A cache hit is still reported as a backend compile
    event by JAX, so ``compiled = events - cache_hits`` is what XLA really compiled."""

    def __init__(self):
        self.events = 0
        self.seconds = 0.0
        self.cache_hits = 0
        self._active = False

    def _on_duration(self, event: str, duration: float, **_) -> None:
        if self._active and event == BACKEND_COMPILE:
            self.events += 1
            self.seconds += duration

    def _on_event(self, event: str, **_) -> None:
        if self._active and event == CACHE_HIT:
            self.cache_hits += 1

    @property
    def compiled(self) -> int:
        return self.events - self.cache_hits

    @contextlib.contextmanager
    def active(self) -> Iterator[CompileCounter]:
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        self._active = True
        try:
            yield self
        finally:
            self._active = False
            jax.monitoring.unregister_event_duration_listener(self._on_duration)
            jax.monitoring.unregister_event_listener(self._on_event)


# ----------------------------------------------------------------------------- output
def machine() -> str:
    """One line describing where the numbers came from."""
    devices = jax.devices()
    load = ""
    if hasattr(os, "getloadavg"):
        load = f", load average {os.getloadavg()[0]:.1f}"
    return (
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores{load}; "
        f"{len(devices)} {devices[0].platform} devices ({devices[0].device_kind}); "
        f"jax {jax.__version__}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; floats get 3 significant digits, None prints as an em dash."""

    def cell(v: Any) -> str:
        if v is None:
            return "—"
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def report(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], notes: Sequence[str] = ()
) -> str:
    """Prints (and returns) a titled table with the machine line and notes under it."""
    text = "\n".join(
        [f"## {title}", "", table(columns, rows), "", f"Machine: {machine()}.", *notes]
    )
    print(text, flush=True)
    return text


def parser(description: str) -> argparse.ArgumentParser:
    """The common command line: ``--quick``, ``--repeats``, ``--no-memory`` and ``--probe``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats per case")
    p.add_argument(
        "--no-memory", action="store_true", help="skip the fresh-process peak-memory probes"
    )
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    return p


def start(doc: str, argv, probe, *, default_repeats: int = 5):
    """The prologue every benchmark's ``main`` shares.

    Parses the common flags and quiets logs; a ``--probe`` child runs ``probe`` and gets None,
    otherwise ``(args, repeats)``.
    """
    args = parser(doc.splitlines()[0]).parse_args(argv)
    quiet_logs()
    if args.probe:
        probe(args.probe, args.quick)
        return None
    return args, args.repeats or (1 if args.quick else default_repeats)


def quiet_logs() -> None:
    """Keeps the estimator's INFO progress lines out of the benchmark's output."""
    import logging

    logging.getLogger("estimator").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.ERROR)
