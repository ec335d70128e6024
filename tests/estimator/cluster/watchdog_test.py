"""The host-loss watchdog's judgement, and its exit, in a real child process (a fake
coordination-service client: the two-process SIGKILL test in
tests/estimator/parallel/multihost_test.py runs it against JAX's real one)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from estimator.cluster import watchdog
from estimator.cluster.cluster import TPUClusterResolver
from estimator.io import step_names


def test_a_peer_is_lost_once_its_counter_is_older_than_the_bound():
    seen = {1: ("7", 100.0), 2: ("3", 104.0)}
    assert watchdog.lost_peer(seen, now=109.0, bound=10, service_ok_at=109.0) is None
    assert watchdog.lost_peer(seen, now=111.0, bound=10, service_ok_at=111.0) == 1
    assert watchdog.lost_peer(seen, now=115.0, bound=10, service_ok_at=115.0) == 1  # lowest
    # A peer that ended normally is never lost.
    assert watchdog.lost_peer({1: ("exited", 0.0)}, now=99.0, bound=10, service_ok_at=99.0) is None
    # A silent coordination service: process 0, which hosts it, is lost.
    assert watchdog.lost_peer({2: ("3", 104.0)}, now=111.0, bound=10, service_ok_at=100.0) == 0


def test_jax_heartbeat_timeout_stays_behind_the_watchdog():
    for bound in (1, 8, 20, 300):
        assert watchdog.jax_heartbeat_timeout(bound) > bound + 5


def test_the_bound_defaults_to_20_seconds_and_can_be_set(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("TPU_ESTIMATOR_HEARTBEAT_TIMEOUT", raising=False)
    assert TPUClusterResolver().timeouts["heartbeat_timeout"] == 20
    assert TPUClusterResolver(heartbeat_timeout=7).timeouts["heartbeat_timeout"] == 7
    monkeypatch.setenv("TPU_ESTIMATOR_HEARTBEAT_TIMEOUT", "9")
    assert TPUClusterResolver().timeouts["heartbeat_timeout"] == 9
    with pytest.raises(ValueError, match="heartbeat_timeout must be a positive int"):
        TPUClusterResolver(heartbeat_timeout=0)


def test_newest_finished_path_reads_the_file_system_only(tmp_path):
    assert step_names.newest_finished_path(str(tmp_path / "missing")) is None
    assert step_names.newest_finished_path(str(tmp_path)) is None
    for name in ("model.ckpt-3", "model.ckpt-12", "model.ckpt-20.orbax-checkpoint-tmp-1"):
        os.makedirs(tmp_path / name)
    assert step_names.newest_finished_path(str(tmp_path)) == str(tmp_path / "model.ckpt-12")
    legacy = tmp_path / "legacy"
    os.makedirs(legacy / "checkpoints" / "4")
    assert step_names.newest_finished_path(str(legacy)) == str(legacy / "checkpoints" / "4")


# A child process: a watchdog (started as the resolver starts it) over a fake client whose
# peer 1 beats a few times, then stops ("stop"), says it exited ("exited"), or beats on
# ("alive"); with "raise" the main thread then raises, as a collective whose peer died does.
_CHILD = textwrap.dedent(
    """
    import json, sys, threading, time
    from estimator import _compat
    from estimator.cluster import watchdog
    from estimator.io import step_names

    model_dir, peer, then = sys.argv[1:]

    class Client:
        def __init__(self):
            self.kv, self.lock = {}, threading.Lock()
        def key_value_set(self, key, value, allow_overwrite=False):
            with self.lock:
                self.kv[key] = value
        def key_value_try_get(self, key):
            return self.kv[key]
        def key_value_dir_get(self, prefix):
            with self.lock:
                return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    client = Client()
    client.key_value_set("tpu_estimator/peer/1", json.dumps({"host": "far", "pid": 4242}))
    _compat.distributed_client = lambda: client
    assert watchdog.start(process_id=0, num_processes=2, bound=1)
    watchdog.watch_model_dir(model_dir, step_names.newest_finished_path)

    def beats(n):
        for i in range(n):
            client.key_value_set("tpu_estimator/beat/1", str(i), True)
            time.sleep(0.1)

    beats(5)
    if peer == "exited":
        client.key_value_set("tpu_estimator/beat/1", "exited", True)
    if peer == "alive":
        threading.Thread(target=beats, args=(1000,), daemon=True).start()
    if then == "raise":
        raise RuntimeError("a collective failed")
    time.sleep(4)
    print("NOT LOST", flush=True)
    """
)


def _child(tmp_path, peer: str, then: str = "wait") -> subprocess.CompletedProcess:
    os.makedirs(tmp_path / "model.ckpt-9")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), peer, then],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _lost_lines(out) -> list[str]:
    return [ln[ln.index("Lost process") :] for ln in out.stderr.splitlines() if "Lost" in ln]


@pytest.mark.parametrize("then", ["wait", "raise"])
def test_a_silent_peer_ends_this_process_with_one_message_and_code_75(tmp_path, then):
    out = _child(tmp_path, "stop", then)
    assert out.returncode == watchdog.HOST_LOST_EXIT_CODE == 75, out.stderr[-2000:]
    assert "NOT LOST" not in out.stdout and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert _lost_lines(out) == [
        "Lost process 1 (host far, pid 4242): it sent no heartbeat for 1 s (heartbeat_timeout). "
        f"Last committed checkpoint: {tmp_path / 'model.ckpt-9'}. Restart every process with "
        "the same command to resume from it. Process 0 exits with code 75."
    ], out.stderr[-2000:]


def test_a_peer_that_exited_normally_is_not_lost(tmp_path):
    out = _child(tmp_path, "exited")
    assert out.returncode == 0 and "NOT LOST" in out.stdout, out.stderr[-2000:]
    assert not _lost_lines(out)


def test_an_error_with_every_peer_alive_is_raised_as_it_is(tmp_path):
    out = _child(tmp_path, "alive", "raise")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "RuntimeError: a collective failed" in out.stderr and not _lost_lines(out)
