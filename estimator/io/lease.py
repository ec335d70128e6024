"""One trainer per model_dir on a bucket: a lease object written with GCS preconditions.

A bucket has no ``flock``, so ``<model_dir>/trainer.lock`` is an object whose every write is
conditional on the generation the writer last saw (GCS's ``ifGenerationMatch``): exactly one
of two writers racing from the same generation succeeds.

* **Acquire**: create it if absent (``ifGenerationMatch=0``), or replace a released or expired
  lease conditionally on the generation read. A live lease refuses at once with
  ``ModelDirInUseError`` naming the holder (host, pid, since), the same contract and message
  as the local lock (``io/lock.py``).
* **Renew**: every ``HEARTBEAT_SECS`` a daemon thread rewrites it, conditionally on its own
  last generation. A renewal refused by the precondition means another trainer took the
  lease over: one error is logged and ``lost`` becomes True.
* **Expire**: a lease not renewed for ``STALE_SECS`` (60 s) belongs to a trainer that died or
  lost the network; one naming this host and a pid that is not running is taken over at once
  (a restart on the same machine, as with the local lock). The age is the bucket's own clock
  (its ``Date`` header minus the object's ``updated`` time), so the hosts' clocks never
  matter.
* **Release**: the object is rewritten as released (conditionally), not deleted, like the
  local lock file that stays, empty.

Other object stores (``s3://``) are written through the same seam without a precondition,
so the lease there is advisory: a warning says so.

Example:
  >>> lease = for_model_dir("gs://bucket/run")     # a TrainerLock for a local path
  >>> lease.acquire()                              # ModelDirInUseError while held elsewhere
  >>> lease.release()
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import socket
import threading
import time
from datetime import datetime
from typing import Any
from urllib.parse import quote

from .. import storage
from ..errors import EstimatorRuntimeError
from .lock import LOCK_NAME, ModelDirInUseError, TrainerLock, _orphaned

log = logging.getLogger("estimator")

HEARTBEAT_SECS = 10.0
STALE_SECS = 60.0
_BOUNDARY = "==lease=="


class _Conflict(EstimatorRuntimeError):
    """The object's generation was not the one the write was conditioned on."""


class _Gcs:
    """The four JSON-API calls a lease needs, through gcsfs's authenticated session."""

    def __init__(self, url: str):
        import gcsfs

        self.fs = gcsfs.GCSFileSystem()
        bucket_and_key = url.split("://", 1)[1]
        self.bucket, _, self.key = bucket_and_key.partition("/")
        self.base = self.fs._location  # the emulator's address when STORAGE_EMULATOR_HOST is set

    def _object(self) -> str:
        return f"{self.base}/storage/v1/b/{quote(self.bucket)}/o/{quote(self.key, safe='')}"

    def read(self) -> tuple[int, dict, float] | None:
        """``(generation, record, age in seconds by the bucket's clock)``, None if absent."""
        try:
            headers, body = self.fs.call("GET", self._object())
        except FileNotFoundError:
            return None
        meta = json.loads(body)
        _, content = self.fs.call("GET", self._object(), alt="media", generation=meta["generation"])
        try:
            record = json.loads(content)
        except ValueError:
            record = {"raw": content[:64].decode(errors="replace")}
        return int(meta["generation"]), record, _age(meta.get("updated"), headers)

    def write(self, record: dict, *, generation: int) -> int:
        """Writes ``record`` if the object is at ``generation`` (0: absent); returns the new one.

        Raises:
          _Conflict: another writer changed it first.
        """
        head = json.dumps({"name": self.key})
        body = (
            (
                f"--{_BOUNDARY}\nContent-Type: application/json; charset=UTF-8\n\n{head}\n"
                f"--{_BOUNDARY}\nContent-Type: application/json\n\n"
            ).encode()
            + json.dumps(record).encode()
            + f"\n--{_BOUNDARY}--".encode()
        )
        try:
            out = self.fs.call(
                "POST",
                f"{self.base}/upload/storage/v1/b/{quote(self.bucket)}/o",
                uploadType="multipart",
                headers={"Content-Type": f'multipart/related; boundary="{_BOUNDARY}"'},
                data=body,
                json_out=True,
                ifGenerationMatch=str(generation),
            )
        except FileExistsError:  # gcsfs's name for HTTP 412, a failed precondition
            raise _Conflict from None
        return int(out["generation"])


def _age(updated: str | None, headers: Any) -> float:
    """Seconds since ``updated`` by the server's ``Date`` header (this host's clock if none)."""
    if not updated:
        return 0.0
    then = datetime.fromisoformat(updated.replace("Z", "+00:00")).timestamp()
    date = headers.get("Date") if hasattr(headers, "get") else None
    now = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
    return max(0.0, now - then)


def _named(record: dict) -> bool:
    return "host" in record and "pid" in record and "raw" not in record


def _describe(record: dict) -> str:
    if not _named(record):
        return "a lease object that names no holder"
    since = f", since {record['since']}" if record.get("since") else ""
    return f"host {record['host']}, pid {record['pid']}{since}"


class BucketLease:
    """The trainer lock of a model_dir on a bucket (see the module docstring).

    Args:
      model_dir: a ``gs://`` URL.
      stale_secs: how long a lease lives without renewal.
      heartbeat_secs: how often the holder renews it.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        stale_secs: float = STALE_SECS,
        heartbeat_secs: float = HEARTBEAT_SECS,
    ):
        self.model_dir = storage.absolute(model_dir)
        self.path = storage.join(self.model_dir, LOCK_NAME)
        self.stale_secs, self.heartbeat_secs = stale_secs, heartbeat_secs
        self._gcs = _Gcs(self.path)
        self._generation: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._lock = threading.Lock()
        self.lost = False

    def _mine(self) -> dict:
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def acquire(self) -> None:
        """Takes the lease, or raises ``ModelDirInUseError`` naming its live holder."""
        for _ in range(3):  # a racing trainer may change it between our read and our write
            found = self._gcs.read()
            try:
                if found is None:
                    self._generation = self._gcs.write(self._mine(), generation=0)
                else:
                    generation, record, age = found
                    # Released, or no holder's record (a local model_dir's empty lock file,
                    # copied up with its checkpoints): free at once, as the local lock's is.
                    released = record.get("released") is True or not _named(record)
                    dead = _orphaned(record)  # this host's trainer, its pid gone: at once
                    if not released and not dead and age < self.stale_secs:
                        raise self._in_use(record)
                    self._generation = self._gcs.write(self._mine(), generation=generation)
                    if not released:
                        log.warning(
                            "Taking over the lease of a trainer that is no longer running "
                            "(not heard from for %.0f s, or gone from this host) (%s): %s",
                            age,
                            _describe(record),
                            self.path,
                        )
            except _Conflict:
                continue
            self._start()
            return
        found = self._gcs.read()
        raise self._in_use(found[1] if found else {})

    def _start(self) -> None:
        self.lost = False
        self._stop.clear()
        self._beat = threading.Thread(target=self._renew, name="trainer-lease", daemon=True)
        self._beat.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.heartbeat_secs):
            with self._lock:
                try:
                    self._generation = self._gcs.write(
                        self._mine(), generation=self._generation or 0
                    )
                except _Conflict:
                    self.lost = True
                    log.error(
                        "The lease of %s was taken over by another trainer (this one was not "
                        "heard from for %.0f s); its checkpoints may now be overwritten.",
                        self.model_dir,
                        self.stale_secs,
                    )
                    return
                except Exception as e:  # noqa: BLE001 - a network blip: try at the next beat
                    log.debug("Renewing the lease of %s failed: %s", self.model_dir, e)

    def _in_use(self, record: dict) -> ModelDirInUseError:
        return ModelDirInUseError(
            f"model_dir {self.model_dir} is in use by another trainer ({_describe(record)}); "
            "two trainers would overwrite each other's checkpoints. Stop that process, or use "
            f"another model_dir. (Lease object: {self.path}; the lease of a trainer that is "
            f"gone is taken over after {self.stale_secs:.0f} s without its renewal.)"
        )

    def release(self) -> None:
        """Marks the lease released (idempotent; nothing if it was taken over meanwhile)."""
        if self._beat is None:
            return
        self._stop.set()
        self._beat.join()
        self._beat = None
        with self._lock:
            if not self.lost:
                try:
                    self._gcs.write({"released": True}, generation=self._generation or 0)
                except _Conflict:
                    pass
                except Exception as e:  # noqa: BLE001 - an expired lease is as good
                    log.warning("Could not release the lease %s (%s).", self.path, e)


class _AdvisoryLease:
    """A store without preconditions: the lock is not enforced (said once)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir

    def acquire(self) -> None:
        log.warning(
            "model_dir %s: one trainer per model_dir is only enforced on local disks and gs:// "
            "buckets (conditional writes); here it is up to you.",
            self.model_dir,
        )

    def release(self) -> None:
        pass


def for_model_dir(model_dir: str) -> TrainerLock | BucketLease | _AdvisoryLease:
    """The one-trainer lock of ``model_dir``: a ``TrainerLock`` for a local path, a
    ``BucketLease`` for ``gs://``, advisory elsewhere."""
    found = storage.scheme(model_dir)
    if found is None:
        return TrainerLock(model_dir)
    if found == "gs":
        return BucketLease(model_dir)
    return _AdvisoryLease(model_dir)
