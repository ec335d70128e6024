"""The watchdog's judgements (a lost peer, a stuck peer, process 0 gone under an abort) and
its exit, in real child processes over a fake coordination-service client. The two-process
ends of each, against JAX's real one: tests/estimator/parallel/multihost_test.py (a peer
killed), tests/estimator/cluster/stall_test.py (a peer stuck) and
tests/estimator/cluster/coordinator_loss_test.py (process 0 killed or stopped)."""

from __future__ import annotations

import os
import signal
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
    with pytest.raises(ValueError, match="heartbeat_timeout must be a positive"):
        TPUClusterResolver(heartbeat_timeout=0)


def test_timeouts_are_positive_numbers_of_seconds(monkeypatch):
    env = watchdog.STALL_TIMEOUT_ENV
    monkeypatch.delenv(env, raising=False)
    seconds = lambda value: watchdog.timeout_seconds("stall_timeout", value, env=env, default=1800)
    assert seconds(None) == 1800.0 and seconds(2.5) == 2.5 and seconds(20) == 20.0
    monkeypatch.setenv(env, "7.5")
    assert seconds(None) == 7.5 and seconds(3) == 3.0  # the argument first
    for bad in (0, -1.0, float("inf"), True, "5"):
        with pytest.raises(ValueError, match=r"stall_timeout must be a positive number"):
            seconds(bad)
    monkeypatch.setenv(env, "soon")
    with pytest.raises(ValueError, match=rf"stall_timeout \(from {env}\) must be .* 'soon'"):
        seconds(None)


def test_the_resolver_takes_float_seconds_and_a_stall_timeout(monkeypatch):
    """(Needs TPUClusterResolver's stall_timeout: see the watchdog's docstring.)"""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv(watchdog.STALL_TIMEOUT_ENV, raising=False)
    resolver = TPUClusterResolver(heartbeat_timeout=20.0, stall_timeout=90.5)
    assert resolver.timeouts["heartbeat_timeout"] == 20.0
    assert resolver.timeouts["stall_timeout"] == 90.5
    assert TPUClusterResolver().timeouts["stall_timeout"] == watchdog.DEFAULT_STALL_TIMEOUT
    monkeypatch.setenv(watchdog.STALL_TIMEOUT_ENV, "120")
    assert TPUClusterResolver().timeouts["stall_timeout"] == 120.0


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
    from estimator.core import _compat
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

    import atexit, jax
    jax.distributed.shutdown = lambda: print("SHUTDOWN", flush=True)

    def threads_at_exit():  # registered first: runs after the watchdog's own exit hook
        alive = [t.name for t in threading.enumerate() if "watchdog" in t.name]
        print("WATCHDOG THREADS AT EXIT:", alive, flush=True)

    atexit.register(threads_at_exit)
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
    # At exit JAX's client is shut down while the judge still runs, then the watchdog's
    # threads end: none is left in a client call when the interpreter finalizes (one that
    # was aborted the process after its work, "FATAL: exception not rethrown").
    lines = out.stdout.splitlines()
    assert lines[-2:] == ["SHUTDOWN", "WATCHDOG THREADS AT EXIT: []"], out.stdout


def test_an_error_with_every_peer_alive_is_raised_as_it_is(tmp_path):
    out = _child(tmp_path, "alive", "raise")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "RuntimeError: a collective failed" in out.stderr and not _lost_lines(out)


# A child process over a fake client, for the stall verdict and the abort guard. ``case``:
# - "stuck": this is process 0, waiting in a collective (a function that lives, as far as
#   its frames say, in JAX's multihost_utils); peer 1 beats on with a record frozen in
#   "input". Once a verdict is published, the peer prints it and leaves (``gone/1``).
# - "told": another process has published a verdict; this one gives it and exits.
# - "abort_gone" / "abort_up": this is process 1; the C library aborts it (as JAX's agent
#   does when the coordination service closes its connections) while the coordinator's port
#   is closed / still accepts connections.
_FAKE_JOB = textwrap.dedent(
    """
    import ctypes, json, os, socket, sys, threading, time
    from jax._src import distributed
    from estimator.core import _compat
    from estimator.cluster import progress, watchdog
    from estimator.io import step_names

    model_dir, case = sys.argv[1:]
    me = 1 if case.startswith("abort") else 0
    peer = 1 - me

    class Client:
        def __init__(self):
            self.kv, self.lock = {}, threading.Lock()
        def key_value_set(self, key, value, allow_overwrite=False):
            with self.lock:
                self.kv[key] = value
        def key_value_dir_get(self, prefix):
            with self.lock:
                return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    client = Client()
    client.key_value_set(f"tpu_estimator/peer/{peer}", json.dumps({"host": "far", "pid": 4242}))
    _compat.distributed_client = lambda: client
    listener = socket.create_server(("127.0.0.1", 0))
    distributed.global_state.coordinator_address = "127.0.0.1:%d" % listener.getsockname()[1]
    if case == "abort_gone":
        listener.close()
    if case == "told":
        client.key_value_set("tpu_estimator/verdict", "Process 1 (host far, pid 4242) is stuck.")

    def peer_beats():
        frozen = progress.Record("input", 6, 5, False, "job.py:9 in input_fn")
        for n in range(100000):
            verdict = client.kv.get("tpu_estimator/verdict")
            if verdict:
                print("PEER READ: " + verdict, flush=True)
                client.key_value_set(f"tpu_estimator/gone/{peer}", "75")
                return
            client.key_value_set(f"tpu_estimator/beat/{peer}", frozen.to_json(n), True)
            time.sleep(0.05)

    threading.Thread(target=peer_beats, daemon=True).start()
    assert watchdog.start(process_id=me, num_processes=2, bound=3, stall_timeout=1.5)
    watchdog.watch_model_dir(model_dir, step_names.newest_finished_path)
    if case.startswith("abort"):
        time.sleep(1)
        ctypes.CDLL(None).abort()  # from C, the GIL released, as a runtime thread would
    for _ in range(5):  # as far as a process 1 at "input" after step 6
        progress.enter("input", 6)
    namespace = {}
    utils = "/venv/lib/python3.11/site-packages/jax/experimental/multihost_utils.py"
    exec(compile("def process_allgather(lock):\\n    lock.acquire()", utils, "exec"), namespace)
    lock = threading.Lock()
    lock.acquire()
    threading.Timer(15, lock.release).start()
    namespace["process_allgather"](lock)  # a collective process 1 never joins
    print("NOT STUCK", flush=True)
    """
)


def _fake_job(tmp_path, case: str) -> subprocess.CompletedProcess:
    os.makedirs(tmp_path / "model.ckpt-9")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    env.pop(watchdog.STALL_TIMEOUT_ENV, None)
    return subprocess.run(
        [sys.executable, "-c", _FAKE_JOB, str(tmp_path), case],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _errors(out) -> list[str]:
    return [ln.split("ERROR:estimator:", 1)[-1] for ln in out.stderr.splitlines() if "ERROR" in ln]


def test_a_stuck_peer_ends_this_process_naming_it_and_what_it_was_doing(tmp_path):
    out = _fake_job(tmp_path, "stuck")
    assert out.returncode == 75 and "NOT STUCK" not in out.stdout, out.stderr[-2000:]
    verdict = (
        "Process 1 (host far, pid 4242) is stuck: no progress for 1.5 s (stall_timeout) in "
        "phase 'input' after step 6, its main thread at job.py:9 in input_fn, while the other "
        f"processes wait for it. Last committed checkpoint: {tmp_path / 'model.ckpt-9'}. "
        "Restart every process with the same command to resume from it."
    )
    assert _errors(out) == [verdict + " Process 0 exits with code 75."], out.stderr[-2000:]
    # Published: the other processes give the same verdict (process 0 waited for them).
    assert f"PEER READ: {verdict}" in out.stdout.splitlines()


def test_a_verdict_another_process_published_is_given_as_it_is(tmp_path):
    out = _fake_job(tmp_path, "told")
    assert out.returncode == 75, out.stderr[-2000:]
    assert _errors(out) == [
        "Process 1 (host far, pid 4242) is stuck. Process 0 exits with code 75."
    ], out.stderr[-2000:]


def test_an_abort_once_the_coordinator_is_gone_exits_75_naming_process_0(tmp_path):
    out = _fake_job(tmp_path, "abort_gone")
    assert out.returncode == 75, out.stderr[-2000:]
    assert _errors(out) == [
        "Lost process 0 (host far, pid 4242): the coordination service it hosts closed its "
        "connections (JAX's runtime was aborting this process). Last committed checkpoint: "
        f"{tmp_path / 'model.ckpt-9'}. Restart every process with the same command to resume "
        "from it. Process 1 exits with code 75."
    ], out.stderr[-2000:]


def test_an_abort_while_the_coordinator_answers_goes_on(tmp_path):
    out = _fake_job(tmp_path, "abort_up")
    assert out.returncode == -signal.SIGABRT and not _errors(out), out.stderr[-2000:]
