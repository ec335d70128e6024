"""TPUClusterResolver: TF_CONFIG and explicit arguments, checked; one process joins nothing."""

from __future__ import annotations

import json

import pytest

import estimator
from estimator.cluster.cluster import ClusterConfigError, TPUClusterResolver, parse_tf_config


def _tf_config(workers, index, kind="worker", **cluster):
    return json.dumps(
        {"cluster": {"worker": workers, **cluster}, "task": {"type": kind, "index": index}}
    )


def test_resolver_reads_tf_config(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _tf_config(["h0:1000", "h1:1001", "h2:1002"], 2))
    r = TPUClusterResolver()
    assert (r.coordinator_address, r.num_processes, r.process_id) == ("h0:1000", 3, 2)
    assert r.cluster_spec() == {"worker": ["h0:1000", "h1:1001", "h2:1002"]}
    assert r.mode == "explicit" and r.master() == "h0:1000"


def test_resolver_chief_is_process_0(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _tf_config(["w0:1", "w1:1"], 1, chief=["c:9"]))
    r = TPUClusterResolver()
    assert (r.coordinator_address, r.num_processes, r.process_id) == ("c:9", 3, 2)
    assert r.cluster_spec() == {"chief": ["c:9"], "worker": ["w0:1", "w1:1"]}
    assert parse_tf_config(_tf_config(["w0:1"], 0, kind="chief", chief=["c:9"]))["process_id"] == 0


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "not valid JSON"),
        (_tf_config(["a:1", "b:2"], 2), r"index'\]=2 is outside the 2 worker"),
        (_tf_config(["a:1"], 0, kind="ps"), "'ps'"),
        (_tf_config(["a:1"], 0, ps=["p:1"]), r"lists \['ps'\]"),
        (_tf_config(["no-port"], 0), "host:port"),
    ],
)
def test_resolver_rejects_bad_tf_config(monkeypatch, text, match):
    monkeypatch.setenv("TF_CONFIG", text)
    with pytest.raises(ClusterConfigError, match=match):
        TPUClusterResolver()


def test_resolver_arguments_must_agree_with_tf_config(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _tf_config(["a:1", "b:2"], 1))
    assert TPUClusterResolver(process_id=1).process_id == 1
    with pytest.raises(ClusterConfigError, match="process_id=0 contradicts TF_CONFIG"):
        TPUClusterResolver(process_id=0)


def test_resolver_arguments_and_timeouts(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("TPU_ESTIMATOR_HEARTBEAT_TIMEOUT", "7")
    r = TPUClusterResolver(
        coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1, shutdown_timeout=3
    )
    assert r.cluster_spec() == {"worker": ["10.0.0.1:1234"]}
    assert r.timeouts == {
        "initialization_timeout": 300,
        "heartbeat_timeout": 7,
        "shutdown_timeout": 3,
        "stall_timeout": 1800.0,
    }
    with pytest.raises(ValueError, match="process_id=2 must be smaller than num_processes=2"):
        TPUClusterResolver(coordinator_address="h:1", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="'host:port'"):
        TPUClusterResolver(coordinator_address="h", num_processes=2, process_id=0)
    with pytest.raises(ValueError, match="heartbeat_timeout must be a positive"):
        TPUClusterResolver(heartbeat_timeout=0)


def test_local_resolver_connects_to_nothing(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    r = TPUClusterResolver()
    assert r.mode == "local" and r.cluster_spec() == {} and r.master() == ""
    r.connect()  # one process: nothing to join
    est = estimator.TPUEstimator(
        lambda features, labels, mode, params: None,
        config=estimator.RunConfig(cluster=r),
        train_batch_size=8,
    )
    assert est.num_replicas == 8
    with pytest.raises(TypeError, match="RunConfig.cluster must be a TPUClusterResolver"):
        estimator.TPUEstimator(
            lambda features, labels, mode, params: None,
            config=estimator.RunConfig(cluster="grpc://x"),
        )


def test_connect_after_devices_were_used_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    r = TPUClusterResolver(coordinator_address="127.0.0.1:1", num_processes=2, process_id=1)
    with pytest.raises(RuntimeError, match="must run before JAX uses any device"):
        r.connect()
