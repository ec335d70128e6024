"""TensorBoard summaries from host code: ``estimator.summary.scalar`` and friends.

Inside a ``host_call`` function the estimator makes a writer (for ``model_dir``) current and
sets the global step of that call, so user code needs no writer or step of its own:

Example:
  >>> def host_fn(loss, lr):
  ...     estimator.summary.scalar("loss_per_replica_mean", loss.mean())
  ...     estimator.summary.scalar("learning_rate", lr[0])
  >>> spec = estimator.TPUEstimatorSpec(mode, loss=loss, train_op=tx,
  ...                                   host_call=(host_fn, [loss[None], lr[None]]))

The step of a host call is the global step *after* that training step (1 for the first
step), the same step the estimator's own ``loss`` summary uses. Outside a host call, make a
writer current yourself with ``record(writer_for(logdir), step)``.

The estimator writes, every ``RunConfig.save_summary_steps`` steps, ``loss`` (that step's
loss, mean over replicas) and, at the end of each loop that crossed such a step,
``global_step/sec`` and ``examples/sec`` (measured over the loops since the previous report;
the first loop, which compiles, only starts the clock). Evaluation results go to
``model_dir/eval`` (or ``eval_<name>``). Only process 0 writes; on other processes these
calls do nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from tensorboardX import SummaryWriter
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto import event_pb2
from tensorboardX.summary import scalar as scalar_summary

_LOCAL = threading.local()
_WRITERS: dict[str, Any] = {}
_RESULTS: dict[str, tuple] = {}  # logdir -> (tensorboardX EventsWriter, its file)
_LOCK = threading.Lock()
_COUNTER = itertools.count()


def writer_for(logdir: str):
    """The shared tensorboardX writer of ``logdir`` (one per directory per process).

    Returns None on processes other than 0, which write nothing.
    """
    if jax.process_index() != 0:
        return None
    logdir = os.path.abspath(logdir)
    with _LOCK:
        w = _WRITERS.get(logdir)
        if w is None:
            # A unique suffix: tensorboardX names files by the second, and two writers opened
            # in the same second in one directory would overwrite each other's file.
            suffix = f".{os.getpid()}.{next(_COUNTER)}"
            w = _WRITERS[logdir] = SummaryWriter(
                logdir=logdir, flush_secs=10, filename_suffix=suffix
            )
        return w


def write_results(logdir: str, values: dict[str, float], step: int) -> None:
    """Appends scalars at ``step`` to this process's one results event file in ``logdir``,
    on disk when this returns (evaluation results, read by early-stopping hooks).

    Unlike ``writer_for``'s queued writer this writes synchronously, so the file can stay open
    across evaluations: one event file per directory per process, as TF's FileWriterCache.
    Does nothing on processes other than 0.
    """
    if jax.process_index() != 0:
        return
    logdir = os.path.abspath(logdir)
    with _LOCK:
        w, path = _RESULTS.get(logdir, (None, None))
        if w is None or not os.path.exists(path):  # new, or the directory was deleted
            os.makedirs(logdir, exist_ok=True)
            suffix = f".{os.getpid()}.{next(_COUNTER)}"
            w = EventsWriter(os.path.join(logdir, "events"), suffix)
            path = w._file_name  # noqa: SLF001 (tensorboardX keeps the name only here)
            _RESULTS[logdir] = (w, path)
        for name, value in values.items():
            event = event_pb2.Event(
                wall_time=time.time(), step=int(step), summary=scalar_summary(name, float(value))
            )
            w.write_event(event)
        w.flush()


def close(logdir: str) -> None:
    """Closes the writer of ``logdir``: every queued event is on disk when this returns."""
    with _LOCK:
        w = _WRITERS.pop(os.path.abspath(logdir), None)
    if w is not None:
        w.close()


@contextlib.contextmanager
def record(writer: Any, step: int) -> Iterator[None]:
    """Makes ``writer`` and ``step`` current for the ``estimator.summary`` functions.

    Example:
      >>> with record(writer_for("/tmp/run"), step=10):
      ...     scalar("accuracy", 0.9)
    """
    prev = getattr(_LOCAL, "current", None)
    _LOCAL.current = (writer, int(step))
    try:
        yield
    finally:
        _LOCAL.current = prev


def _target(step: int | None) -> tuple[Any, int]:
    current = getattr(_LOCAL, "current", None)
    if current is None:
        raise RuntimeError(
            "estimator.summary functions write to the writer the estimator makes current; call "
            "them from a host_call function (or inside summary.record(writer, step))"
        )
    writer, default_step = current
    return writer, default_step if step is None else int(step)


def _value(name: str, x: Any) -> float:
    arr = np.asarray(x)
    if arr.size != 1:
        raise ValueError(f"summary.scalar({name!r}) needs a single value, got shape {arr.shape}")
    return float(arr.reshape(()))


def scalar(name: str, value: Any, step: int | None = None) -> None:
    """Writes a scalar at ``step`` (default: the global step of the current host call).

    Raises:
      ValueError: ``value`` has more than one element.
    """
    writer, step = _target(step)
    value = _value(name, value)
    if writer is not None:
        writer.add_scalar(name, value, global_step=step)


def histogram(name: str, values: Any, step: int | None = None, bins: str = "tensorflow") -> None:
    """Writes a histogram of ``values`` (any shape) at ``step``."""
    writer, step = _target(step)
    if writer is not None:
        writer.add_histogram(name, np.asarray(values), global_step=step, bins=bins)


def image(name: str, data: Any, step: int | None = None, dataformats: str = "HWC") -> None:
    """Writes an image (uint8, or float in [0, 1]); ``dataformats`` as in tensorboardX."""
    writer, step = _target(step)
    if writer is not None:
        writer.add_image(name, np.asarray(data), global_step=step, dataformats=dataformats)


def text(name: str, data: str, step: int | None = None) -> None:
    """Writes a text summary (markdown in TensorBoard's text plugin) at ``step``."""
    writer, step = _target(step)
    if writer is not None:
        writer.add_text(name, str(data), global_step=step)


class TrainSummaries:
    """The estimator's own training summaries: loss and speed every ``every`` steps.

    Called once per device loop, from the thread that waited for it, so the clock measures
    the device loops. ``loss`` is written for each step of the loop that is a multiple of
    ``every``; ``global_step/sec`` and ``examples/sec`` at the loop's last step when the
    loop crossed such a step, measured since the previous report (the first loop only
    starts the clock, so compilation is not counted).

    Args:
      writer: a tensorboardX writer, or None (writes nothing).
      every: ``RunConfig.save_summary_steps``; 0 or None turns these summaries off.
      examples_per_step: the global batch size.
      clock: seconds, monotonic (for tests).
    """

    def __init__(
        self,
        writer: Any,
        *,
        every: int | None,
        examples_per_step: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.writer = writer
        self.every = every or 0
        self.examples_per_step = examples_per_step
        self._clock = clock
        self._last: tuple[int, float] | None = None  # (step, time) of the last report

    def after_loop(
        self, losses: np.ndarray, steps: np.ndarray, nonfinite: int | None = None
    ) -> None:
        """Records one loop: per-step ``losses`` at global ``steps`` (after each step)."""
        now = self._clock()
        if self.writer is None or not self.every or not len(steps):
            return
        pairs = zip(np.asarray(losses).reshape(-1), steps, strict=True)
        due = [(float(loss), int(s)) for loss, s in pairs if s % self.every == 0]
        for loss, step in due:
            self.writer.add_scalar("loss", loss, global_step=step)
            if nonfinite is not None:
                self.writer.add_scalar("nonfinite_steps", nonfinite, global_step=step)
        end = int(steps[-1])
        if self._last is None:
            self._last = (end, now)
            return
        if due:
            self._speed(end, now)

    def _speed(self, step: int, now: float) -> None:
        last_step, last_time = self._last
        if now <= last_time or step <= last_step:
            return
        steps_per_sec = (step - last_step) / (now - last_time)
        self.writer.add_scalar("global_step/sec", steps_per_sec, global_step=step)
        if self.examples_per_step:
            self.writer.add_scalar(
                "examples/sec", steps_per_sec * self.examples_per_step, global_step=step
            )
        self._last = (step, now)
