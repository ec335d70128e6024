"""TensorBoard summaries from host code: ``estimator.summary.scalar`` and friends.

Inside a ``host_call`` function the estimator makes a writer current and sets the step of the
call, so user code needs no writer or step of its own:

Example:
  >>> def host_fn(loss, lr):
  ...     estimator.summary.scalar("loss", loss.mean())
  ...     estimator.summary.scalar("learning_rate", lr[0])
  >>> spec = estimator.TPUEstimatorSpec(mode, loss=loss, train_op=tx,
  ...                                   host_call=(host_fn, [loss[None], lr[None]]))

Only process 0 writes; on other processes these calls do nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from typing import Any

import numpy as np

_LOCAL = threading.local()
_WRITERS: dict[str, Any] = {}
_LOCK = threading.Lock()
_COUNTER = itertools.count()


def writer_for(logdir: str):
    """The shared tensorboardX writer of ``logdir`` (one per directory per process)."""
    import jax
    from tensorboardX import SummaryWriter

    if jax.process_index() != 0:
        return None
    logdir = os.path.abspath(logdir)
    with _LOCK:
        w = _WRITERS.get(logdir)
        if w is None:
            # A unique suffix: tensorboardX names files by the second, and two writers opened
            # in the same second in one directory would overwrite each other's file.
            suffix = f".{os.getpid()}.{next(_COUNTER)}"
            w = _WRITERS[logdir] = SummaryWriter(logdir=logdir, flush_secs=10,
                                                 filename_suffix=suffix)
        return w


def flush_all() -> None:
    with _LOCK:
        for w in _WRITERS.values():
            w.flush()


def close(logdir: str) -> None:
    with _LOCK:
        w = _WRITERS.pop(os.path.abspath(logdir), None)
    if w is not None:
        w.close()


@contextlib.contextmanager
def record(writer, step: int):
    """Makes ``writer`` and ``step`` current for the ``estimator.summary`` functions."""
    prev = getattr(_LOCAL, "current", None)
    _LOCAL.current = (writer, int(step))
    try:
        yield
    finally:
        _LOCAL.current = prev


def _target(step: int | None):
    current = getattr(_LOCAL, "current", None)
    if current is None:
        raise RuntimeError(
            "estimator.summary functions write to the writer the estimator makes current; call "
            "them from a host_call or metric function (or inside summary.record(writer, step))"
        )
    writer, default_step = current
    return writer, default_step if step is None else int(step)


def _value(x: Any) -> float:
    arr = np.asarray(x)
    if arr.size != 1:
        raise ValueError(f"summary.scalar needs a single value, got shape {arr.shape}")
    return float(arr.reshape(()))


def scalar(name: str, value: Any, step: int | None = None) -> None:
    """Writes a scalar at ``step`` (default: the global step of the current host call)."""
    writer, step = _target(step)
    if writer is not None:
        writer.add_scalar(name, _value(value), global_step=step)


def histogram(name: str, values: Any, step: int | None = None, bins: str = "tensorflow") -> None:
    writer, step = _target(step)
    if writer is not None:
        writer.add_histogram(name, np.asarray(values), global_step=step, bins=bins)


def image(name: str, data: Any, step: int | None = None, dataformats: str = "HWC") -> None:
    """Writes an image (uint8 or float in [0, 1]); ``dataformats`` as in tensorboardX."""
    writer, step = _target(step)
    if writer is not None:
        writer.add_image(name, np.asarray(data), global_step=step, dataformats=dataformats)


def text(name: str, data: str, step: int | None = None) -> None:
    writer, step = _target(step)
    if writer is not None:
        writer.add_text(name, str(data), global_step=step)
