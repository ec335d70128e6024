"""Reads scalar eval results back from TensorBoard event files, without TensorFlow.

Event files are TFRecord streams: each record is ``uint64 length``, ``uint32 masked
crc32c(length)``, ``data``, ``uint32 masked crc32c(data)`` (little endian), and each ``data``
is an ``Event`` protocol buffer (parsed with tensorboardX's generated ``event_pb2``). A
truncated last record, as left by a writer that is mid-write, ends the file quietly; a
corrupt record ends it with a warning; a record whose checksums are valid but whose data is
not an ``Event`` (another program's record, a bad write) is skipped, with one warning per
file per process (readers poll, so not one per read).

Example:
  >>> import tempfile
  >>> from tensorboardX import SummaryWriter
  >>> d = tempfile.mkdtemp()
  >>> with SummaryWriter(d) as w:
  ...     w.add_scalar("accuracy", 0.75, 100)
  >>> read_eval_metrics(d)
  {100: {'accuracy': 0.75}}
"""

from __future__ import annotations

import glob
import os
import struct
from collections.abc import Iterator

import numpy as np
from etils import epath
from google.protobuf.message import DecodeError

from hooks import _tensorboardx  # noqa: F401  (imports tensorboardX without torch)

# isort: split
from tensorboardX.crc32c import crc32c
from tensorboardX.proto import event_pb2, types_pb2

from hooks import _util

_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")
_MASK_DELTA = 0xA282EAD8
_warned_not_events: set[str] = set()  # files already warned about (see the docstring)

_FLOAT_FIELDS = {
    types_pb2.DT_FLOAT: ("float_val", np.float32),
    types_pb2.DT_DOUBLE: ("double_val", np.float64),
    types_pb2.DT_HALF: ("half_val", np.float16),
    types_pb2.DT_BFLOAT16: ("half_val", None),
    types_pb2.DT_INT32: ("int_val", np.int32),
    types_pb2.DT_INT64: ("int64_val", np.int64),
}


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _is_url(path: str) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")


def _open(path: str):
    return epath.Path(path).open("rb") if _is_url(path) else open(path, "rb")  # noqa: SIM115


def read_records(path: str) -> Iterator[bytes]:
    """Yields the data of each complete, checksummed TFRecord in the file at ``path``.

    Stops quietly at a truncated last record and with a warning at a corrupt one.
    """
    with _open(path) as f:
        while True:
            header = f.read(_HEADER.size)
            if len(header) < _HEADER.size:
                return
            length, length_crc = _HEADER.unpack(header)
            if _masked_crc(header[:8]) != length_crc:
                _util.logger.warning("Corrupt record length in %s; ignoring the rest.", path)
                return
            data = f.read(length)
            footer = f.read(_FOOTER.size)
            if len(data) < length or len(footer) < _FOOTER.size:
                return  # still being written
            if _masked_crc(data) != _FOOTER.unpack(footer)[0]:
                _util.logger.warning("Corrupt record data in %s; ignoring the rest.", path)
                return
            yield data


def summary_iterator(path: str) -> Iterator[event_pb2.Event]:
    """Yields every ``Event`` in one event file (``tf.compat.v1.train.summary_iterator``).

    Records that are not ``Event`` protocol buffers are skipped (see the module docstring).
    """
    skipped = 0
    for data in read_records(path):
        try:
            event = event_pb2.Event.FromString(data)
        except DecodeError:
            skipped += 1
            continue
        yield event
    if skipped and path not in _warned_not_events:
        _warned_not_events.add(path)
        _util.logger.warning(
            "Skipped %d record(s) in %s that are not Event protocol buffers (their checksums "
            "are valid: not a torn write); the rest of the file was read.",
            skipped,
            path,
        )


def scalar_value(value: event_pb2.Summary.Value) -> float | None:
    """The float in a summary value: ``simple_value`` or a scalar tensor; else ``None``."""
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        return float(value.simple_value)
    if kind != "tensor":
        return None
    tensor = value.tensor
    if any(d.size != 1 for d in tensor.tensor_shape.dim) or tensor.dtype not in _FLOAT_FIELDS:
        return None
    field, dtype = _FLOAT_FIELDS[tensor.dtype]
    if tensor.tensor_content:
        if dtype is None:  # bfloat16: the high half of a float32
            raw = np.frombuffer(tensor.tensor_content, np.uint16).astype(np.uint32) << 16
            return float(raw.view(np.float32)[0])
        return float(np.frombuffer(tensor.tensor_content, dtype)[0])
    values = getattr(tensor, field)
    if not len(values):
        return None
    if tensor.dtype == types_pb2.DT_HALF:  # half_val holds the raw 16 bits
        return float(np.array(values[0], np.uint16).view(np.float16))
    if tensor.dtype == types_pb2.DT_BFLOAT16:
        return float(np.array(values[0] << 16, np.uint32).view(np.float32))
    return float(values[0])


def event_files(directory: str) -> list[str]:
    """The event files directly in ``directory``, sorted by name (i.e. by creation time)."""
    if _is_url(directory):  # an object store (gs://...), read through etils.epath
        root = epath.Path(directory)
        return sorted(str(p) for p in root.glob("*tfevents*")) if root.is_dir() else []
    return sorted(glob.glob(os.path.join(glob.escape(directory), "*tfevents*")))


def read_eval_metrics(eval_dir: str) -> dict[int, dict[str, float]]:
    """Scalar summaries in ``eval_dir``'s event files, keyed by global step, steps ascending.

    Like TF's ``tf.estimator.experimental.read_eval_metrics``: later events for the same step
    and tag (later in a file, or in a later file) override earlier ones.

    Args:
      eval_dir: the directory an evaluation wrote its summaries to (may not exist yet).

    Returns:
      ``{global_step: {tag: value}}`` ordered by global step.
    """
    results: dict[int, dict[str, float]] = {}
    for path in event_files(eval_dir):
        for event in summary_iterator(path):
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                scalar = scalar_value(value)
                if scalar is not None:
                    results.setdefault(int(event.step), {})[value.tag] = scalar
    return dict(sorted(results.items()))
