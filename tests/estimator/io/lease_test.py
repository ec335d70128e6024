"""The bucket lease against a GCS emulator (fake-gcs-server on 127.0.0.1, the ``gcs_url``
fixture): one trainer per model_dir on a bucket, with the local lock's contract and messages.

A holder that stops renewing (stuck, or cut off from the bucket) is made by holding its
write lock: its heartbeat thread then waits, as one blocked on the network would.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time

import pytest

import estimator
from estimator.io import lease
from estimator.io.lock import TrainerLock

HOLDER = rf"host {socket.gethostname()}, pid {os.getpid()}, since \S+"


def _poll(condition, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return result


def _takes(contender: lease.BucketLease) -> bool:
    try:
        contender.acquire()
    except estimator.ModelDirInUseError:
        return False
    return True


def _plant(url: str, record: dict) -> None:
    """Writes a lease object by hand, as another trainer (or a copy of a model_dir) left it."""
    gcs = lease._Gcs(f"{url}/trainer.lock")
    found = gcs.read()
    gcs.write_bytes(json.dumps(record).encode(), generation=found.generation if found else 0)


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_each_store_gets_its_lock_and_making_one_touches_nothing(tmp_path):
    started = time.monotonic()
    assert isinstance(lease.for_model_dir(str(tmp_path)), TrainerLock)
    local = lease.for_model_dir(f"file://{tmp_path}/run")
    assert isinstance(local, TrainerLock) and local.model_dir == str(tmp_path / "run")
    bucket = lease.for_model_dir("gs://no-such-bucket/run/")
    assert isinstance(bucket, lease.BucketLease)
    assert bucket.path == "gs://no-such-bucket/run/trainer.lock"
    assert not isinstance(lease.for_model_dir("s3://b/run"), (TrainerLock, lease.BucketLease))
    assert time.monotonic() - started < 5  # no credentials looked up before acquire
    with pytest.raises(ValueError, match="heartbeat_secs"):
        lease.BucketLease("gs://b/run", stale_secs=2, heartbeat_secs=1.5)


def test_a_second_trainer_is_refused_at_once_naming_the_holder(gcs_url):
    first = lease.BucketLease(gcs_url)
    first.acquire()
    try:
        started = time.monotonic()
        with pytest.raises(estimator.ModelDirInUseError, match=HOLDER) as e:
            lease.BucketLease(gcs_url).acquire()
        assert time.monotonic() - started < 5
        assert f"model_dir {gcs_url} is in use by another trainer" in str(e.value)
        assert f"{gcs_url}/trainer.lock" in str(e.value)
    finally:
        first.release()
    second = lease.BucketLease(gcs_url)  # released: free at once
    second.acquire()
    second.release()
    second.release()  # idempotent


def test_a_renewed_lease_stays_held(gcs_url):
    holder = lease.BucketLease(gcs_url, heartbeat_secs=0.2)
    holder.acquire()
    try:
        started, first = time.monotonic(), holder._generation
        _poll(lambda: time.monotonic() - started > 3, "three seconds")
        assert holder._generation != first  # renewed
        with pytest.raises(estimator.ModelDirInUseError, match=HOLDER):
            lease.BucketLease(gcs_url, stale_secs=2.0).acquire()  # older than 2 s, renewed
        assert not holder.lost
    finally:
        holder.release()


def test_an_expired_lease_is_taken_over_and_its_holder_learns_it(gcs_url, caplog):
    holder = lease.BucketLease(gcs_url, heartbeat_secs=0.2)
    holder.acquire()
    taker = lease.BucketLease(gcs_url, stale_secs=1.0)
    try:
        with holder._writing, caplog.at_level("WARNING", logger="estimator"):  # stuck
            _poll(lambda: _takes(taker), "the lease to expire")
        (line,) = [r.getMessage() for r in caplog.records if "Taking over" in r.getMessage()]
        assert "no longer running" in line and "not renewed for" in line
        assert holder.path in line and "pid" in line
        caplog.clear()
        with caplog.at_level("ERROR", logger="estimator"):
            _poll(lambda: holder.lost, "the old holder to learn it lost the lease")
        (line,) = [r.getMessage() for r in caplog.records if "taken over" in r.getMessage()]
        assert f"host {socket.gethostname()}, pid {os.getpid()}" in line  # the taker named
        holder.release()  # does not release the taker's lease
        with pytest.raises(estimator.ModelDirInUseError):
            lease.BucketLease(gcs_url).acquire()
    finally:
        taker.release()
        holder.release()


def test_two_simultaneous_takeovers_have_one_winner(gcs_url):
    old = lease.BucketLease(gcs_url, heartbeat_secs=0.2)
    old.acquire()
    takers = [lease.BucketLease(gcs_url, stale_secs=1.0) for _ in range(4)]
    with old._writing:  # stuck: its lease expires
        _poll(lambda: takers[0]._gcs.read().age >= 1.5, "the lease to expire")
        barrier, outcomes = threading.Barrier(len(takers)), []

        def take(t: lease.BucketLease) -> None:
            barrier.wait()
            try:
                t.acquire()
                outcomes.append("won")
            except estimator.ModelDirInUseError as e:
                outcomes.append("refused" if "host" in str(e) else str(e))

        threads = [threading.Thread(target=take, args=(t,)) for t in takers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert sorted(outcomes) == ["refused", "refused", "refused", "won"]
    _poll(lambda: old.lost, "the old holder to learn it lost the lease")
    for t in [old, *takers]:
        t.release()


def test_a_lease_of_a_process_gone_from_this_host_is_taken_over_at_once(gcs_url, caplog):
    record = {"host": socket.gethostname(), "pid": _dead_pid(), "since": "then"}
    _plant(gcs_url, {**record, "machine": lease._machine()})
    with caplog.at_level("WARNING", logger="estimator"):
        taker = lease.BucketLease(gcs_url)
        taker.acquire()  # at once: not the 60 s of an expiry
    taker.release()
    assert any("its process is gone from this host" in r.getMessage() for r in caplog.records)
    # The same host name in another pid namespace (a container) is not this process table.
    _plant(gcs_url, {**record, "machine": "another-boot/4026531836"})
    with pytest.raises(estimator.ModelDirInUseError, match=f"pid {record['pid']}"):
        lease.BucketLease(gcs_url).acquire()


@pytest.mark.parametrize("content", [{}, {"raw": "garbage"}, {"released": True}])
def test_a_lease_object_that_names_no_holder_is_free_at_once(gcs_url, content):
    _plant(gcs_url, content)
    taker = lease.BucketLease(gcs_url)
    taker.acquire()
    taker.release()


def test_a_write_whose_response_was_lost_is_recognised_as_ours(gcs_url):
    """gcsfs retries a request whose response it did not get; if the first attempt had
    landed, the retry meets our own generation and is refused (HTTP 412)."""
    holder = lease.BucketLease(gcs_url, heartbeat_secs=0.2)
    real, calls = holder._gcs.write_bytes, []

    def landed_then_refused(data: bytes, *, generation: int) -> int:
        written = real(data, generation=generation)
        calls.append(generation)
        if len(calls) <= 2:  # the acquire and the first renewal
            raise lease._Conflict("the retry met our own write")
        return written

    holder._gcs.write_bytes = landed_then_refused
    holder.acquire()
    try:
        _poll(lambda: len(calls) >= 4, "two more renewals")
        assert not holder.lost
    finally:
        holder.release()
    taker = lease.BucketLease(gcs_url)
    taker.acquire()  # the release was conditioned on the right generation
    taker.release()
