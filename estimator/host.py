"""Host-side work: host_call and metric_fn run on a worker thread, in order, off the device.

Per-step host tensors come back from a loop stacked ``[n, global_rows, ...]``; this module
slices them per step, removes padded rows, calls the user's functions and keeps the first
error to raise in the caller's thread with its original traceback.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

import metrics as metrics_lib

from . import summary


class HostWorker:
    """One background thread running submitted callables in submission order."""

    def __init__(self, name: str = "host-calls"):
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            task = self._queue.get()
            try:
                if task is None:
                    return
                if self._error is None:
                    task()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self._error = e
            finally:
                self._queue.task_done()

    def submit(self, task: Callable[[], None]) -> None:
        self.check()
        self._queue.put(task)

    def check(self) -> None:
        """Raises the first error a task raised, with its original traceback."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def join(self) -> None:
        """Waits for every submitted task, then raises the first error."""
        self._queue.join()
        self.check()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)


def call_host_fn(fn: Callable, tensors: Any) -> Any:
    """list -> positional arguments, dict -> keywords, as TPUEstimator did."""
    if isinstance(tensors, Mapping):
        return fn(**tensors)
    return fn(*tensors)


def run_host_calls(fn: Callable, tensors: Any, steps: np.ndarray, every_n: int,
                   writer: Any) -> None:
    """Calls ``fn`` for each step of a loop whose global step is a multiple of ``every_n``."""
    for i, step in enumerate(steps):
        if step % every_n:
            continue
        per_step = _index(tensors, i)
        with summary.record(writer, int(step)):
            call_host_fn(fn, per_step)


def _index(tensors: Any, i: int) -> Any:
    if isinstance(tensors, Mapping):
        return {k: v[i] for k, v in tensors.items()}
    return [v[i] for v in tensors]


def real_rows(tensors: Any, host_mask: np.ndarray) -> Any:
    """Concatenates a loop's per-step tensors, keeping only rows of real examples.

    A tensor whose per-step rows equal the global batch is filtered by the padding mask; one
    with another leading size (e.g. one row per replica) is concatenated as it is.
    """
    keep = host_mask.reshape(-1)
    rows = host_mask.shape[1]

    def one(v):
        v = np.asarray(v)
        flat = v.reshape(v.shape[0] * v.shape[1], *v.shape[2:])
        return flat[keep] if v.shape[1] == rows else flat

    if isinstance(tensors, Mapping):
        return {k: one(v) for k, v in tensors.items()}
    return [one(v) for v in tensors]


RESERVED_METRIC_NAMES = ("loss", "global_step")


class MetricAccumulator:
    """Merges what metric_fn returns, per name, over every eval batch."""

    def __init__(self):
        self.metrics: dict[str, metrics_lib.Metric] = {}

    def update(self, metric_fn: Callable, tensors: Any, num_examples: int) -> None:
        out = call_host_fn(metric_fn, tensors)
        if not isinstance(out, Mapping):
            raise TypeError(
                f"metric_fn must return a dict of name -> metrics.Metric, got {type(out).__name__}"
            )
        for name, value in out.items():
            if name in RESERVED_METRIC_NAMES:
                raise ValueError(
                    f"metric_fn returned the reserved metric name {name!r}; the estimator "
                    "reports 'loss' and 'global_step' itself"
                )
            if not isinstance(value, metrics_lib.Metric):
                if np.ndim(value) != 0 and np.size(value) != 1:
                    raise TypeError(
                        f"metric_fn returned {name!r} of shape {np.shape(value)}; return a "
                        "metrics.Metric or a scalar"
                    )
                value = metrics_lib.as_metric(np.asarray(value).reshape(()), num_examples)
            prev = self.metrics.get(name)
            self.metrics[name] = value if prev is None else prev.merge(value)

    def compute(self) -> dict[str, Any]:
        out = {}
        for name, m in self.metrics.items():
            value = m.compute()
            out[name] = float(value) if np.ndim(value) == 0 else np.asarray(value)
        return out
