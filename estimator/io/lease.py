"""One trainer per model_dir on a bucket: a lease object written with GCS preconditions.

A bucket has no ``flock``, so ``<model_dir>/trainer.lock`` is a JSON object whose every write
is conditional on the generation the writer last saw (GCS's ``ifGenerationMatch``, sent
through gcsfs's authenticated JSON-API session): of two writers racing from the same
generation exactly one succeeds.

* **Acquire**: create it if absent (``ifGenerationMatch=0``), or replace a released, expired
  or orphaned lease conditionally on the generation read, so that of two trainers taking it
  over at once only one wins. A live lease refuses at once with ``ModelDirInUseError`` naming
  the holder (host, pid, since): the contract and message of the local lock (``io/lock.py``).
* **Renew**: every ``heartbeat_secs`` (10 s) a daemon thread rewrites it, conditionally on the
  generation it last wrote. A renewal refused by the precondition means another trainer took
  the lease over: one error naming the taker is logged, renewing stops, and ``lost`` is True.
* **Expire**: a lease not renewed for ``stale_secs`` (``STALE_SECS``, 60 s) belongs to a
  trainer that died or lost the network, and is taken over with a warning naming it. Its age
  is measured by the bucket's clock alone (the server's ``Date`` header minus the object's
  ``updated`` time), so the hosts' clocks never matter; the ``renewed`` time each record
  carries (the writer's clock) is only for people reading the object. A lease naming this
  host, this boot and pid namespace, and a pid that is not running is taken over at once (a
  restart on the same machine, as with the local lock); a container sharing the host name
  but not the pid namespace never counts as "this host".
* **Release**: the object is rewritten as released (conditionally), not deleted: the local
  lock file likewise stays, empty. (fake-gcs-server, the emulator the tests run against,
  ignores ``ifGenerationMatch`` on ``DELETE``, so a deleting release could not be tested,
  and there it could delete a lease another trainer had just taken.)

A write whose response is lost and which gcsfs retries meets its own generation and is
refused; each record carries a fresh ``token``, so the writer reads the object back and
recognises its own write. Other object stores (``s3://``) get no enforced lease: a warning
says so.

Example:
  >>> lease = for_model_dir("gs://bucket/run")  # a TrainerLock for a local path
  >>> lease.acquire()                           # ModelDirInUseError while held elsewhere
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
import uuid
from datetime import datetime
from typing import Any, NamedTuple
from urllib.parse import quote

from .. import storage
from ..core.errors import EstimatorRuntimeError, EstimatorValueError
from .lock import LOCK_NAME, ModelDirInUseError, TrainerLock, _pid_running

log = logging.getLogger("estimator")

HEARTBEAT_SECS = 10.0
STALE_SECS = 60.0
_BOUNDARY = "==lease=="


class _Conflict(EstimatorRuntimeError):
    """The object's generation was not the one the write was conditioned on (HTTP 412)."""


class _Found(NamedTuple):
    generation: int
    record: dict[str, Any]
    age: float  # seconds since its last write, by the bucket's clock


class _Gcs:
    """The JSON-API calls a lease needs, through gcsfs's authenticated session.

    Args:
      url: the object's ``gs://bucket/key``.
      fs: a ``gcsfs.GCSFileSystem``; made on first use if None (making one may probe for
        credentials, 15 s offline, so a lease that is never acquired never makes one).
    """

    def __init__(self, url: str, *, fs: Any = None):
        self.bucket, _, self.key = url.split("://", 1)[1].partition("/")
        self._fs = fs

    @property
    def fs(self) -> Any:
        if self._fs is None:
            import gcsfs

            self._fs = gcsfs.GCSFileSystem()
        return self._fs

    def _object(self) -> str:
        # fs._location is the emulator's address when STORAGE_EMULATOR_HOST is set.
        bucket, key = quote(self.bucket, safe=""), quote(self.key, safe="")
        return f"{self.fs._location}/storage/v1/b/{bucket}/o/{key}"

    def read(self) -> _Found | None:
        """The object's generation, record and age; None if there is none."""
        for _ in range(5):
            try:
                headers, body = self.fs.call("GET", self._object())
            except FileNotFoundError:
                return None
            meta = json.loads(body)
            try:
                _, content = self.fs.call(
                    "GET", self._object(), alt="media", generation=meta["generation"]
                )
            except FileNotFoundError:
                continue  # replaced between our two requests: read the new one
            return _Found(int(meta["generation"]), _parse(content), _age(meta, headers))
        raise _Conflict(f"{self.bucket}/{self.key} changed five times while being read")

    def write_bytes(self, data: bytes, *, generation: int) -> int:
        """Writes ``data`` if the object is at ``generation`` (0: absent).

        Returns:
          The object's new generation.

        Raises:
          _Conflict: the object was not at ``generation``.
        """
        head = json.dumps({"name": self.key, "contentType": "application/json"})
        body = (
            f"--{_BOUNDARY}\nContent-Type: application/json; charset=UTF-8\n\n{head}\n"
            f"--{_BOUNDARY}\nContent-Type: application/json\n\n"
        ).encode()
        body += data + f"\n--{_BOUNDARY}--".encode()
        try:
            out = self.fs.call(
                "POST",
                f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o",
                uploadType="multipart",
                headers={"Content-Type": f'multipart/related; boundary="{_BOUNDARY}"'},
                data=body,
                json_out=True,
                ifGenerationMatch=str(generation),
            )
        except FileExistsError:  # gcsfs's name for HTTP 412, a failed precondition
            raise _Conflict(f"{self.bucket}/{self.key} is not at generation {generation}") from None
        return int(out["generation"])


def _parse(content: bytes) -> dict[str, Any]:
    try:
        record = json.loads(content)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        return {"raw": content[:64].decode(errors="replace")}
    return record


def _age(meta: dict[str, Any], headers: Any) -> float:
    """Seconds since the object's ``updated`` time, by the server's ``Date`` header.

    ``Date`` has whole seconds, so the age comes out up to 1 s short: a lease expires late,
    never early. Without a ``Date`` header (no server seen here omits it) this host's clock
    stands in.
    """
    updated = meta.get("updated")
    if not updated:
        return 0.0
    then = datetime.fromisoformat(updated.replace("Z", "+00:00")).timestamp()
    date = headers.get("Date") if hasattr(headers, "get") else None
    now = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
    return max(0.0, now - then)


def _machine() -> str | None:
    """This boot and pid namespace: what makes a pid on "this host" mean this process table."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # not Linux: a same-host holder is waited out like any other
        return None


def _named(record: dict[str, Any]) -> bool:
    return "host" in record and "pid" in record and "raw" not in record


def _describe(record: dict[str, Any]) -> str:
    if not _named(record):
        return "a lease object that names no holder"
    since = f", since {record['since']}" if record.get("since") else ""
    return f"host {record['host']}, pid {record['pid']}{since}"


def _gone_from_this_host(record: dict[str, Any]) -> bool:
    pid, machine = record.get("pid"), _machine()
    return (
        machine is not None
        and record.get("machine") == machine
        and record.get("host") == socket.gethostname()
        and isinstance(pid, int)
        and pid != os.getpid()
        and not _pid_running(pid)
    )


class BucketLease:
    """The trainer lock of a model_dir on a bucket (see the module docstring).

    Args:
      model_dir: a ``gs://`` URL.
      stale_secs: how long a lease lives without renewal before another trainer may take it
        over. Every trainer of one model_dir should use the same value.
      heartbeat_secs: how often the holder renews it; by default ``HEARTBEAT_SECS``, or a
        quarter of ``stale_secs`` if that is shorter. Keep it at 1 s or more on real GCS,
        which allows about one write a second to one object.

    Raises:
      EstimatorValueError: ``model_dir`` is not a ``gs://`` URL, or the heartbeat is not
        well inside ``stale_secs``.

    Example:
      >>> lease = BucketLease("gs://bucket/run", stale_secs=60)
      >>> lease.acquire()
      >>> lease.lost  # True once another trainer has taken it over
      False
      >>> lease.release()
    """

    def __init__(
        self,
        model_dir: str,
        *,
        stale_secs: float = STALE_SECS,
        heartbeat_secs: float | None = None,
    ):
        if storage.scheme(model_dir) != "gs":
            raise EstimatorValueError(f"A bucket lease needs a gs:// model_dir, not {model_dir!r}.")
        if heartbeat_secs is None:
            heartbeat_secs = min(HEARTBEAT_SECS, stale_secs / 4)
        if not 0 < heartbeat_secs <= stale_secs / 2:
            raise EstimatorValueError(
                f"heartbeat_secs ({heartbeat_secs}) must be positive and at most half of "
                f"stale_secs ({stale_secs}), or a live holder's lease would look expired."
            )
        self.model_dir = storage.absolute(model_dir)
        self.path = storage.join(self.model_dir, LOCK_NAME)
        self.stale_secs, self.heartbeat_secs = stale_secs, heartbeat_secs
        self._gcs = _Gcs(self.path)
        self._generation = 0
        self._since = ""
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._writing = threading.Lock()  # a renewal and the release never interleave
        self._lost = False

    @property
    def lost(self) -> bool:
        """Whether another trainer took this lease over while it was held."""
        return self._lost

    def _record(self) -> dict[str, Any]:
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": self._since,
            "renewed": time.time(),  # the writer's clock: for people; expiry uses the bucket's
            "machine": _machine(),
            "token": uuid.uuid4().hex,
        }

    def _write(self, record: dict[str, Any], generation: int) -> int:
        """A conditional write that recognises its own earlier attempt (see the docstring)."""
        try:
            return self._gcs.write_bytes(json.dumps(record).encode(), generation=generation)
        except _Conflict:
            found = self._gcs.read()
            if found is not None and found.record.get("token") == record["token"]:
                return found.generation  # a retried request whose first attempt had landed
            raise

    def _live(self, found: _Found) -> bool:
        record = found.record
        if record.get("released") is True or not _named(record):
            # Released, or no holder's record (e.g. a local model_dir's empty lock file copied
            # up with its checkpoints): free at once, as the local lock's is.
            return False
        return found.age < self.stale_secs and not _gone_from_this_host(record)

    def acquire(self) -> None:
        """Takes the lease.

        Raises:
          ModelDirInUseError: a live trainer holds it (named, with host, pid and since).
        """
        self._since = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        for _ in range(5):  # another trainer may change it between our read and our write
            found = self._gcs.read()
            if found is not None and self._live(found):
                raise self._in_use(found.record)
            try:
                self._generation = self._write(self._record(), found.generation if found else 0)
            except _Conflict:
                continue
            if found is not None and _named(found.record) and not found.record.get("released"):
                self._warn_taking_over(found)
            self._start()
            return
        found = self._gcs.read()
        raise self._in_use(found.record if found else {})

    def _warn_taking_over(self, found: _Found) -> None:
        why = (
            "its process is gone from this host"
            if found.age < self.stale_secs
            else f"not renewed for {found.age:.0f} s"
        )
        log.warning(
            "Taking over the lease of a trainer that is no longer running (%s; %s): %s",
            _describe(found.record),
            why,
            self.path,
        )

    def _start(self) -> None:
        self._lost = False
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="trainer-lease", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        failing_since: float | None = None
        while not self._stop.wait(self.heartbeat_secs):
            try:
                if not self._renew_once():
                    return
                failing_since = None
            except Exception as e:  # noqa: BLE001 - the network: try again at the next beat
                now = time.monotonic()
                failing_since = failing_since or now
                level = (
                    logging.WARNING if now - failing_since > self.stale_secs / 2 else logging.DEBUG
                )
                log.log(level, "Renewing the lease %s failed (%s); retrying.", self.path, e)

    def _renew_once(self) -> bool:
        """Renews the lease; False (and ``lost``) if another trainer has taken it over."""
        with self._writing:
            if self._stop.is_set() or self._lost:
                return False
            try:
                self._generation = self._write(self._record(), self._generation)
                return True
            except _Conflict:
                self._lost = True
            found = self._gcs.read()
        taker = _describe(found.record) if found is not None else "deleted"
        log.error(
            "The lease of %s was taken over by another trainer (%s) after this one was not "
            "heard from for %.0f s; two trainers may now write its checkpoints: stop one.",
            self.model_dir,
            taker,
            self.stale_secs,
        )
        return False

    def _in_use(self, record: dict[str, Any]) -> ModelDirInUseError:
        return ModelDirInUseError(
            f"model_dir {self.model_dir} is in use by another trainer ({_describe(record)}); "
            "two trainers would overwrite each other's checkpoints. Stop that process, or use "
            f"another model_dir. (Lease object: {self.path}; the lease of a trainer that is "
            f"gone is taken over after {self.stale_secs:.0f} s without its renewal, at once "
            "on the same host.)"
        )

    def release(self) -> None:
        """Marks the lease released (idempotent; nothing if it was taken over meanwhile)."""
        if self._beat is None:
            return
        self._stop.set()
        self._beat.join()
        self._beat = None
        with self._writing:
            if self._lost:
                return
            record = {"released": True, "by": _describe(self._record()), "token": uuid.uuid4().hex}
            try:
                self._write(record, self._generation)
            except _Conflict:
                pass  # taken over since our last renewal: not ours to release
            except Exception as e:  # noqa: BLE001 - it expires by itself
                log.warning(
                    "Could not release the lease %s (%s); it expires in %.0f s.",
                    self.path,
                    e,
                    self.stale_secs,
                )


class _AdvisoryLease:
    """A store without conditional writes: the lock is not enforced (said once)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.lost = False

    def acquire(self) -> None:
        log.warning(
            "model_dir %s: one trainer per model_dir is only enforced on local disks and gs:// "
            "buckets (conditional writes); here it is up to you.",
            self.model_dir,
        )

    def release(self) -> None:
        pass


def for_model_dir(model_dir: str) -> TrainerLock | BucketLease | _AdvisoryLease:
    """The one-trainer lock of ``model_dir``, for its store.

    Args:
      model_dir: a local path (``file://`` too) or a URL.

    Returns:
      A ``TrainerLock`` for a local path, a ``BucketLease`` for ``gs://``, and for other
      stores (no conditional writes through fsspec) a lock that only warns. Nothing is read
      or written until ``acquire``.

    Example:
      >>> type(for_model_dir("gs://bucket/run")).__name__
      'BucketLease'
    """
    found = storage.scheme(model_dir)
    if found is None:
        return TrainerLock(storage.absolute(model_dir))
    if found == "gs":
        return BucketLease(model_dir)
    return _AdvisoryLease(model_dir)
