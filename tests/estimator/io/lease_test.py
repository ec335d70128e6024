"""The bucket lease against a GCS emulator (fake-gcs-server on 127.0.0.1): one trainer per
model_dir on a bucket, with the local lock's contract and messages."""

from __future__ import annotations

import threading
import time

import pytest

import estimator
from estimator.io import lease
from estimator.io.lock import TrainerLock


def _poll(condition, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return result


def test_a_local_path_gets_the_local_lock_and_a_bucket_the_lease(tmp_path):
    assert isinstance(lease.for_model_dir(str(tmp_path)), TrainerLock)
    assert isinstance(lease.for_model_dir("gs://b/run"), lease.BucketLease)


def test_a_second_trainer_is_refused_at_once_naming_the_holder(gcs_url):
    first = lease.BucketLease(gcs_url)
    first.acquire()
    try:
        with pytest.raises(estimator.ModelDirInUseError, match=r"host \S+, pid \d+") as e:
            lease.BucketLease(gcs_url).acquire()
        assert gcs_url in str(e.value) and "trainer.lock" in str(e.value)
    finally:
        first.release()
    second = lease.BucketLease(gcs_url)  # released: free at once
    second.acquire()
    second.release()


def test_a_renewed_lease_stays_held(gcs_url):
    holder = lease.BucketLease(gcs_url, heartbeat_secs=0.2)
    holder.acquire()
    try:
        first = holder._generation
        _poll(lambda: holder._generation != first, "a renewal")
        with pytest.raises(estimator.ModelDirInUseError):
            lease.BucketLease(gcs_url, stale_secs=30).acquire()
        assert not holder.lost
    finally:
        holder.release()


def test_an_expired_lease_is_taken_over_and_its_holder_learns_it(gcs_url, caplog):
    holder = lease.BucketLease(gcs_url, heartbeat_secs=1.0)
    holder._renew = lambda: None  # a holder that stopped renewing (stuck, or cut off)
    holder.acquire()
    taker = lease.BucketLease(gcs_url, stale_secs=1.0)

    def taken() -> bool:
        try:
            taker.acquire()
        except estimator.ModelDirInUseError:
            return False
        return True

    with caplog.at_level("WARNING", logger="estimator"):
        _poll(taken, "the lease to expire")
    assert any("Taking over the lease" in r.message for r in caplog.records)
    try:
        with pytest.raises(estimator.ModelDirInUseError):  # the taker holds it now
            lease.BucketLease(gcs_url, stale_secs=30).acquire()
        del holder._renew  # renewing again: the precondition fails, the loss is known
        holder._beat = threading.Thread(target=holder._renew, daemon=True)
        holder._beat.start()
        _poll(lambda: holder.lost, "the old holder to learn it lost the lease")
        holder.release()  # does not release the taker's lease
        with pytest.raises(estimator.ModelDirInUseError):
            lease.BucketLease(gcs_url, stale_secs=30).acquire()
    finally:
        taker.release()


def test_two_simultaneous_takeovers_have_one_winner(gcs_url):
    old = lease.BucketLease(gcs_url)
    old._renew = lambda: None
    old.acquire()
    probe = lease.BucketLease(gcs_url)
    _poll(lambda: probe._gcs.read()[2] >= 1.0, "the lease to age")
    takers = [lease.BucketLease(gcs_url, stale_secs=1.0) for _ in range(4)]
    barrier, outcomes = threading.Barrier(len(takers)), []

    def take(t):
        barrier.wait()
        try:
            t.acquire()
            outcomes.append("won")
        except estimator.ModelDirInUseError:
            outcomes.append("refused")

    threads = [threading.Thread(target=take, args=(t,)) for t in takers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(outcomes) == ["refused", "refused", "refused", "won"]
    for t in takers:
        t.release()
