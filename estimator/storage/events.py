"""TensorBoard event files on an object store (``gs://``, ``s3://``): tensorboardX writers.

tensorboardX opens an event file through a writer factory chosen by the path's scheme; its
own ``gs://`` writer needs ``google-cloud-storage`` and its ``s3://`` one ``boto3``. These
factories go through ``storage`` (etils.epath, so gcsfs or s3fs) instead, for every scheme
the storage seam serves. An object store cannot append: the file is kept in memory and the
whole object rewritten at each flush, as TF's GCS file system did; a reader (TensorBoard, the
early-stopping hooks) sees every event flushed so far.

Example:
  >>> register()                       # once; summary.py does it on import
  >>> SummaryWriter("gs://bucket/run")  # now writes gs://bucket/run/events.out.tfevents.*
"""

from __future__ import annotations

import io
import threading

from hooks import _tensorboardx  # noqa: F401  (imports tensorboardX without torch)

# isort: split
from tensorboardX import record_writer

from . import files as storage

SCHEMES = ("gs", "s3")


class _StoreFile:
    """One event file on a store: bytes in memory, the object rewritten on ``flush``."""

    def __init__(self, path: str):
        self.path = path
        self._buffer = io.BytesIO()
        self._flushed = -1  # bytes in the object (-1: not written yet)
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            self._buffer.write(data)

    def flush(self) -> None:
        with self._lock:
            data = self._buffer.getvalue()
            if len(data) != self._flushed:
                storage.write_bytes(self.path, data)
                self._flushed = len(data)

    def close(self) -> None:
        self.flush()


class _StoreFactory:
    def open(self, path: str) -> _StoreFile:
        return _StoreFile(path)

    def directory_check(self, path: str) -> None:
        del path  # an object store has no directories to create


def register() -> None:
    """Makes tensorboardX write event files for ``SCHEMES`` through the storage seam."""
    for scheme in SCHEMES:
        record_writer.register_writer_factory(scheme, _StoreFactory())
