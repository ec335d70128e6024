"""Host-side work: host_call and metric_fn run on a worker thread, in order, off the device.

Per-step host tensors come back from a loop stacked ``[n, global_rows, ...]``; this module
slices them per step, removes padded rows, calls the user's functions and keeps the first
error to raise in the caller's thread with its original traceback.

Example:
  >>> worker = HostWorker()
  >>> seen = []
  >>> run = lambda: run_host_calls(lambda x: seen.append(x.tolist()),
  ...                              [np.arange(6).reshape(3, 2)], np.array([1, 2, 3]),
  ...                              every_n=1, writer=None)
  >>> worker.submit(run)
  >>> worker.join(); worker.close()
  >>> seen
  [[0, 1], [2, 3], [4, 5]]
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

import metrics as metrics_lib

from ..core import summary
from ..core.errors import EstimatorTypeError, EstimatorValueError
from ..data import threads
from ..engine.traced import check_no_traced_values, traced_value_guard

HOST_CALL_QUEUE_LOOPS = 2  # loops of host work that may wait behind the one running


class HostWorker:
    """One pooled background thread running submitted callables in submission order.

    The first error a task raises is kept and raised by the next ``check``/``join``/``submit``
    in the caller's thread, with its original traceback; every task after it is skipped, so
    a failed host call stops all host work.

    Args:
      name: the thread's name.
      max_queued: with a number, ``submit`` waits while that many tasks wait behind the
        running one, so a caller (the device loop) never runs further ahead of the host than
        that; None queues without bound.
    """

    def __init__(self, name: str = "host-calls", *, max_queued: int | None = None):
        self._queue: queue.Queue = queue.Queue()
        self._max_queued = max_queued
        self._pending = 0  # submitted and not finished (queued + running)
        self._changed = threading.Condition()
        self._error: BaseException | None = None
        self._failed = False
        self._ended = threads.run_in_thread(self._run, name=name)  # pooled: none per call

    def _run(self):
        while True:
            task, _ = self._queue.get()
            try:
                if task is None:
                    return
                if not self._failed:
                    task()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self._failed = True
                self._error = e
            finally:
                self._done(1)

    def _done(self, n: int) -> None:
        with self._changed:
            self._pending -= n
            self._changed.notify_all()

    @property
    def failed(self) -> bool:
        """Whether a task has raised (later tasks are skipped)."""
        return self._failed

    @property
    def pending(self) -> int:
        """Tasks submitted and not finished (the running one included)."""
        return self._pending

    def submit(
        self,
        task: Callable[[], None],
        *,
        what: Any = None,
        interrupt: threading.Event | None = None,
    ) -> None:
        """Queues ``task``; first waits while ``max_queued`` tasks wait behind the running
        one, unless ``interrupt`` is set. ``what`` describes it to ``cancel``."""
        self.check()
        with self._changed:
            while (
                self._max_queued is not None
                and self._pending > self._max_queued
                and not self._failed
                and not (interrupt is not None and interrupt.is_set())
            ):
                self._changed.wait(timeout=0.1)
            self._pending += 1
        self._queue.put((task, what))

    def check(self) -> None:
        """Raises the first error a task raised (once), with its original traceback."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def drain(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for every submitted task; whether all finished."""
        with self._changed:
            return self._changed.wait_for(lambda: self._pending <= 0, timeout=timeout)

    def cancel(self) -> list:
        """Drops the tasks not yet started; returns their ``what``, in order."""
        dropped = []
        while True:
            try:
                task, what = self._queue.get_nowait()
            except queue.Empty:
                break
            if task is None:  # keep a close request
                self._queue.put((None, None))
                break
            dropped.append(what)
        if dropped:
            self._done(len(dropped))
        return dropped

    def join(self) -> None:
        """Waits for every submitted task, then raises the first error."""
        self.drain(timeout=None)
        self.check()

    def close(self, timeout: float = 30) -> None:
        """Stops the thread after the tasks queued; waits up to ``timeout`` seconds."""
        with self._changed:
            self._pending += 1
        self._queue.put((None, None))
        self._ended.wait(timeout=timeout)


def call_host_fn(
    fn: Callable, tensors: Any, *, what: str = "host function", check: bool = True
) -> Any:
    """list -> positional arguments, dict -> keywords, as TPUEstimator did.

    ``check=False`` skips the captured-value check (done once per loop by the callers).
    """
    if check:
        check_no_traced_values(fn, what)
    with traced_value_guard(what):
        if isinstance(tensors, Mapping):
            return fn(**tensors)
        return fn(*tensors)


def _index(tensors: Any, i: int) -> Any:
    if isinstance(tensors, Mapping):
        return {k: np.asarray(v[i]) for k, v in tensors.items()}
    return [np.asarray(v[i]) for v in tensors]


# ----------------------------------------------------------------------------- host_call
def run_host_calls(
    fn: Callable, tensors: Any, steps: np.ndarray, every_n: int, writer: Any
) -> None:
    """Calls ``fn`` once per step of a loop, in order, thinned by ``every_n``.

    Args:
      fn: the host_call function.
      tensors: the loop's host tensors, each stacked ``[n, global_rows, ...]``.
      steps: the global step after each of the ``n`` steps.
      every_n: call only where the global step is a multiple of this
        (``TPUConfig.host_call_every_n_steps``).
      writer: the writer ``estimator.summary`` writes to during each call (or None).
    """
    check_no_traced_values(fn, "host_call")
    for i, step in enumerate(steps):
        if int(step) % every_n:
            continue
        with summary.record(writer, int(step)):
            call_host_fn(fn, _index(tensors, i), what="host_call", check=False)


# ----------------------------------------------------------------------------- eval_metrics
def batch_rows(tensors: Any, keep: np.ndarray | None, i: int) -> Any:
    """Step ``i``'s tensors with padded rows removed (``keep``: that step's row mask, or None
    when every row is real, so nothing is copied).

    A tensor whose rows equal the global batch is filtered by the padding mask; one with
    another leading size (e.g. one row per replica) is passed as it is.
    """

    def one(v):
        v = np.asarray(v[i])
        return v if keep is None or v.shape[0] != keep.shape[0] else v[keep]

    if isinstance(tensors, Mapping):
        return {k: one(v) for k, v in tensors.items()}
    return [one(v) for v in tensors]


RESERVED_METRIC_NAMES = ("loss", "global_step")
_METRIC_FN = "eval_metrics' metric_fn"


class MetricAccumulator:
    """Merges what metric_fn returns, per name, over every eval batch.

    A ``metrics.Metric`` is merged; a plain number is an example-weighted mean over batches.
    """

    def __init__(self):
        self.metrics: dict[str, metrics_lib.Metric] = {}

    def update_loop(self, metric_fn: Callable, tensors: Any, host_mask: np.ndarray) -> None:
        """Runs ``metric_fn`` once per eval batch of a loop that has real rows."""
        check_no_traced_values(metric_fn, _METRIC_FN)
        counts = host_mask.sum(axis=1).tolist()  # real rows per step, in one pass
        width = host_mask.shape[1]
        for i, num_examples in enumerate(counts):
            if num_examples:
                keep = None if num_examples == width else host_mask[i]
                self.update(metric_fn, batch_rows(tensors, keep, i), num_examples, check=False)

    def update(
        self, metric_fn: Callable, tensors: Any, num_examples: int, *, check: bool = True
    ) -> None:
        """Runs ``metric_fn`` on one batch's real rows and merges what it returns."""
        out = call_host_fn(metric_fn, tensors, what=_METRIC_FN, check=check)
        if not isinstance(out, Mapping):
            raise EstimatorTypeError(
                f"metric_fn must return a dict of name -> metrics.Metric, got {type(out).__name__}"
            )
        for name, value in out.items():
            if name in RESERVED_METRIC_NAMES:
                raise EstimatorValueError(
                    f"metric_fn returned the reserved metric name {name!r}; the estimator "
                    "reports 'loss' and 'global_step' itself"
                )
            if not isinstance(value, metrics_lib.Metric):
                value = _scalar_metric(name, value, num_examples)
            prev = self.metrics.get(name)
            self.metrics[name] = value if prev is None else prev.merge(value)

    def compute(self) -> dict[str, Any]:
        out = {}
        for name, m in self.metrics.items():
            value = m.compute()
            out[name] = float(value) if np.ndim(value) == 0 else np.asarray(value)
        return out


def _scalar_metric(name: str, value: Any, num_examples: int) -> metrics_lib.Metric:
    if isinstance(value, tuple) and len(value) == 2:
        raise EstimatorTypeError(
            f"metric_fn returned {name!r} as a (value, update_op) pair; in JAX return a "
            "metrics.Metric (e.g. metrics.mean(values)) or a plain scalar"
        )
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise EstimatorTypeError(
            f"metric_fn returned {name!r} of type {type(value).__name__}; return a "
            "metrics.Metric or a scalar"
        ) from None
    if arr.size != 1:
        raise EstimatorTypeError(
            f"metric_fn returned {name!r} of shape {arr.shape}; return a metrics.Metric or a scalar"
        )
    return metrics_lib.as_metric(arr.reshape(()), num_examples)
