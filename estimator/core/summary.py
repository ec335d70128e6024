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
step), the same step the estimator's own ``loss`` summary uses.

TF 1's ``tf.contrib.summary`` idiom works as written (ResNet's host_call):

  >>> def host_call_fn(gs, loss):
  ...     with summary.create_file_writer(model_dir, max_queue=100).as_default():
  ...         with summary.always_record_summaries():
  ...             summary.scalar("loss", loss[0], step=gs[0])
  ...             return summary.all_summary_ops()

``record_summaries_every_n_global_steps(n)`` and ``never_record_summaries()`` gate what is
written; writers opened this way are closed (on disk) when ``train`` returns.

Outside a host call, make a writer current yourself with ``record(writer_for(logdir), step)``.

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
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from hooks import _tensorboardx  # noqa: F401  (imports tensorboardX without torch)

# isort: split
from tensorboardX import SummaryWriter
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto import event_pb2
from tensorboardX.summary import scalar as scalar_summary

from hooks.timer import SecondOrStepTimer

from .. import storage
from ..storage import events as store_events
from .errors import EstimatorRuntimeError, EstimatorValueError

store_events.register()  # event files on gs:// and s3:// through the storage seam

_LOCAL = threading.local()
_WRITERS: dict[str, Any] = {}
_RESULTS: dict[str, tuple] = {}  # logdir -> (tensorboardX EventsWriter, its file)
_LOCK = threading.Lock()
_COUNTER = itertools.count()


def writer_for(logdir: str, *, max_queue: int | None = None, flush_millis: float | None = None):
    """The shared tensorboardX writer of ``logdir`` (one per directory per process).

    ``max_queue`` (events held before a write) and ``flush_millis`` apply when this call
    opens the directory. Returns None on processes other than 0, which write nothing.
    """
    if jax.process_index() != 0:
        return None
    logdir = storage.absolute(logdir)
    with _LOCK:
        w = _WRITERS.get(logdir)
        if w is None:
            # A unique suffix: tensorboardX names files by the second, and two writers opened
            # in the same second in one directory would overwrite each other's file.
            suffix = f".{os.getpid()}.{next(_COUNTER)}"
            options = {"flush_secs": 10 if flush_millis is None else flush_millis / 1000.0}
            if max_queue is not None:
                options["max_queue"] = int(max_queue)
            w = _WRITERS[logdir] = SummaryWriter(logdir=logdir, filename_suffix=suffix, **options)
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
    logdir = storage.absolute(logdir)
    with _LOCK:
        w, path = _RESULTS.get(logdir, (None, None))
        if w is None or not storage.exists(path):  # new, or the directory was deleted
            storage.makedirs(logdir)
            suffix = f".{os.getpid()}.{next(_COUNTER)}"
            w = EventsWriter(storage.join(logdir, "events"), suffix)
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
        w = _WRITERS.pop(storage.absolute(logdir), None)
    if w is not None:
        try:
            w.close()
        except OSError as e:  # a full disk: say where, and let the real error (if any) stand
            logging.getLogger("estimator").warning(
                "The last summaries could not be written to %s (%s).", logdir, e.strerror or e
            )


@contextlib.contextmanager
def record(writer: Any, step: int | None) -> Iterator[None]:
    """Makes ``writer`` and ``step`` current for the ``estimator.summary`` functions
    (``step=None``: each call must pass its own ``step``).

    Example:
      >>> with record(writer_for("/tmp/run"), step=10):
      ...     scalar("accuracy", 0.9)
    """
    prev = getattr(_LOCAL, "current", None)
    _LOCAL.current = (writer, None if step is None else int(np.asarray(step).reshape(())))
    try:
        yield
    finally:
        _LOCAL.current = prev


def _target(step: Any) -> tuple[Any, int]:
    """(writer, step) to write to; the writer is None when nothing should be written (another
    process, or a recording condition that says no)."""
    current = getattr(_LOCAL, "current", None)
    if current is None:
        raise EstimatorRuntimeError(
            "estimator.summary functions write to the writer the estimator makes current; call "
            "them from a host_call function (or inside summary.record(writer, step), or "
            "create_file_writer(logdir).as_default())"
        )
    writer, default_step = current
    step = default_step if step is None else int(np.asarray(step).reshape(()))
    if step is None:
        raise EstimatorValueError(
            "no global step is current here: pass step= to the summary function"
        )
    return (writer if _should_record(step) else None), step


def _tag(name: str, family: str | None) -> str:
    return name if not family else f"{family}/{name}"


def _value(name: str, x: Any) -> float:
    arr = np.asarray(x)
    if arr.size != 1:
        raise EstimatorValueError(
            f"summary.scalar({name!r}) needs a single value, got shape {arr.shape}"
        )
    return float(arr.reshape(()))


def scalar(name: str, value: Any, step: int | None = None, *, family: str | None = None) -> None:
    """Writes a scalar at ``step`` (default: the global step of the current host call).

    ``family`` (TF's) prefixes the tag: ``family/name``.

    Raises:
      ValueError: ``value`` has more than one element.
    """
    writer, step = _target(step)
    value = _value(name, value)
    if writer is not None:
        writer.add_scalar(_tag(name, family), value, global_step=step)


def histogram(
    name: str,
    values: Any,
    step: int | None = None,
    bins: str = "tensorflow",
    *,
    family: str | None = None,
) -> None:
    """Writes a histogram of ``values`` (any shape) at ``step``."""
    writer, step = _target(step)
    if writer is not None:
        writer.add_histogram(_tag(name, family), np.asarray(values), global_step=step, bins=bins)


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


# --------------------------------------------------------------------------- tf.contrib.summary
# The TF 1 idiom of host_call functions (ResNet's):
#     with summary.create_file_writer(model_dir, max_queue=ipl).as_default():
#         with summary.always_record_summaries():
#             summary.scalar("loss", loss[0], step=gs)
#             return summary.all_summary_ops()
_OPENED: set[str] = set()  # logdirs opened by create_file_writer, closed by close_file_writers


class FileWriter:
    """The writer ``create_file_writer`` returns: ``as_default()`` makes it current.

    Inside ``as_default()`` the ``estimator.summary`` functions write to this directory; the
    step is the one passed to them, else the current host call's global step.
    """

    def __init__(self, logdir: str, *, max_queue: int | None, flush_millis: float | None):
        self.logdir = storage.absolute(logdir)
        self._options = {"max_queue": max_queue, "flush_millis": flush_millis}

    def _writer(self):
        with _LOCK:
            _OPENED.add(self.logdir)
        return writer_for(self.logdir, **self._options)

    @contextlib.contextmanager
    def as_default(self) -> Iterator[FileWriter]:
        current = getattr(_LOCAL, "current", None)
        step = current[1] if current is not None else None
        with record(self._writer(), step):
            yield self

    def flush(self) -> None:
        writer = self._writer()
        if writer is not None:
            writer.flush()

    def close(self) -> None:
        close(self.logdir)

    def __repr__(self) -> str:
        return f"FileWriter({self.logdir!r})"


def create_file_writer(
    logdir: str,
    max_queue: int | None = None,
    flush_millis: float | None = None,
    filename_suffix: str | None = None,
    name: str | None = None,
) -> FileWriter:
    """TF's ``tf.contrib.summary.create_file_writer``: a writer for ``logdir``.

    One writer is shared per directory and process (the estimator's own for ``model_dir``);
    the estimator closes the writers opened here when ``train`` returns, so every event is on
    disk then. ``max_queue`` and ``flush_millis`` apply when this call opens the directory;
    ``filename_suffix`` and ``name`` are accepted and unused.

    Example:
      >>> def host_call_fn(gs, loss):
      ...     with summary.create_file_writer(model_dir, max_queue=100).as_default():
      ...         with summary.always_record_summaries():
      ...             summary.scalar("loss", loss[0], step=gs[0])
      ...             return summary.all_summary_ops()
    """
    del filename_suffix, name
    if not isinstance(logdir, (str, os.PathLike)) or not str(logdir):
        raise EstimatorValueError(f"create_file_writer needs a directory, got {logdir!r}")
    return FileWriter(str(logdir), max_queue=max_queue, flush_millis=flush_millis)


@contextlib.contextmanager
def _recording(condition: Callable[[int | None], bool]) -> Iterator[None]:
    prev = getattr(_LOCAL, "condition", None)
    _LOCAL.condition = condition
    try:
        yield
    finally:
        _LOCAL.condition = prev


def always_record_summaries():
    """Context in which summaries are written at every step (the default here)."""
    return _recording(lambda step: True)


def never_record_summaries():
    """Context in which the summary functions write nothing."""
    return _recording(lambda step: False)


def record_summaries_every_n_global_steps(n: int, global_step: Any = None):
    """Context in which summaries are written only when the step is a multiple of ``n``.

    Args:
      n: a positive int.
      global_step: the step to test (a number or one-element array); default the step each
        summary is written at.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0:
        raise EstimatorValueError(f"record_summaries_every_n_global_steps needs n > 0, got {n!r}")
    fixed = None if global_step is None else int(np.asarray(global_step).reshape(()))

    def condition(step: int | None) -> bool:
        s = fixed if fixed is not None else step
        return s is not None and s % int(n) == 0

    return _recording(condition)


def should_record_summaries() -> bool:
    """Whether a summary written now at the current step would be recorded."""
    current = getattr(_LOCAL, "current", None)
    return _should_record(current[1] if current is not None else None)


def _should_record(step: int | None) -> bool:
    condition = getattr(_LOCAL, "condition", None)
    return True if condition is None else bool(condition(step))


def record_if(condition: Any):
    """TF2's ``tf.summary.record_if``: a context in which summaries are written only while
    ``condition`` holds.

    Args:
      condition: a bool, a one-element array, or a zero-argument callable returning one
        (called at each summary, as TF does).

    Example:
      >>> with summary.create_file_writer(model_dir).as_default():
      ...     with summary.record_if(True):
      ...         summary.scalar("loss", loss[0], step=gs[0])
    """
    if callable(condition):
        return _recording(lambda step: _truth(condition()))
    value = _truth(condition)
    return _recording(lambda step: value)


def _truth(value: Any) -> bool:
    try:
        arr = np.asarray(value)
        ok = arr.dtype.kind in "biuf"
        truth = bool(arr.reshape(())) if ok else False
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise EstimatorValueError(
            f"record_if needs a bool, a one-element array or a callable returning one, got "
            f"{value!r}"
        )
    return truth


def all_summary_ops() -> list:
    """TF's list of summary ops to run; summaries here are written as they are called: []."""
    return []


def all_v2_summary_ops() -> list:
    """TF2's ``tf.compat.v1.summary.all_v2_summary_ops``, returned from host_call as TF
    programs do; summaries here are written as they are called: []."""
    return []


def close_file_writers() -> None:
    """Closes every writer ``create_file_writer`` opened (their events are then on disk)."""
    with _LOCK:
        opened = sorted(_OPENED)
        _OPENED.clear()
    for logdir in opened:
        close(logdir)


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
        # The speed since the last report, measured as StepCounterHook measures it.
        self._meter = SecondOrStepTimer(every_steps=1, clock=clock)
        self._started = False

    def after_loop(
        self,
        losses: np.ndarray,
        steps: np.ndarray,
        nonfinite: int | None = None,
        *,
        loss_scale: float | None = None,
    ) -> None:
        """Records one loop: per-step ``losses`` at global ``steps`` (after each step);
        ``nonfinite`` and ``loss_scale`` are the values at the loop's end."""
        now = self._clock()
        if self.writer is None or not self.every or not len(steps):
            return
        pairs = zip(np.asarray(losses).reshape(-1), steps, strict=True)
        due = [(float(loss), int(s)) for loss, s in pairs if s % self.every == 0]
        for loss, step in due:
            self.writer.add_scalar("loss", loss, global_step=step)
            if nonfinite is not None:
                self.writer.add_scalar("nonfinite_steps", nonfinite, global_step=step)
            if loss_scale is not None:
                self.writer.add_scalar("loss_scale", loss_scale, global_step=step)
        end = int(steps[-1])
        if not self._started:  # the first loop only starts the clock (compilation not counted)
            self._meter.update_last_triggered_step(end, now)
            self._started = True
            return
        if due and self._meter.should_trigger_for_step(end, now):
            self._speed(end, now)

    def _speed(self, step: int, now: float) -> None:
        secs, steps = self._meter.update_last_triggered_step(step, now)
        if not secs or secs <= 0 or not steps:
            return
        steps_per_sec = steps / secs
        self.writer.add_scalar("global_step/sec", steps_per_sec, global_step=step)
        if self.examples_per_step:
            self.writer.add_scalar(
                "examples/sec", steps_per_sec * self.examples_per_step, global_step=step
            )
