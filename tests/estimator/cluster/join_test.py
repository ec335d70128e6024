"""RunConfig joins the job the environment describes (TF_CONFIG, JAX's detection) unless told
otherwise, so a TF-style script runs unchanged under the local launcher as one job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import jax
import pytest

import estimator
from estimator.cluster import cluster as cluster_lib
from tests.estimator import _tf_style_job as job

TWO_WORKERS = json.dumps(
    {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 1}}
)


def _no_op_model_fn(features, labels, mode, params):
    return None


@pytest.fixture
def backend_started(monkeypatch):
    """JAX's backend is up (as in any test process), so joining a job can only fail fast."""
    monkeypatch.delenv(cluster_lib.NO_CLUSTER_ENV, raising=False)
    jax.devices()


def test_a_tf_config_job_is_joined_by_default(monkeypatch, backend_started):
    """No cluster given: the estimator tries to join TF_CONFIG's job (here it cannot: the
    backend already started), and the message names where the job came from and the two
    ways to run alone."""
    monkeypatch.setenv("TF_CONFIG", TWO_WORKERS)
    assert cluster_lib.from_environment().process_id == 1
    with pytest.raises(RuntimeError, match="must run before JAX uses any device") as e:
        estimator.TPUEstimator(_no_op_model_fn, config=estimator.RunConfig(), train_batch_size=8)
    message = str(e.value)
    assert "the job TF_CONFIG describes" in message
    assert "RunConfig(cluster=False)" in message and "TPU_ESTIMATOR_NO_CLUSTER=1" in message


@pytest.mark.parametrize("how", ["cluster=False", "TPU_ESTIMATOR_NO_CLUSTER=1"])
def test_running_alone_is_one_argument_or_one_variable(monkeypatch, backend_started, how):
    monkeypatch.setenv("TF_CONFIG", TWO_WORKERS)
    if how == "cluster=False":
        config = estimator.RunConfig(cluster=False)
    else:
        monkeypatch.setenv(cluster_lib.NO_CLUSTER_ENV, "1")
        assert cluster_lib.from_environment() is None
        config = estimator.RunConfig()
    est = estimator.TPUEstimator(_no_op_model_fn, config=config, train_batch_size=8)
    assert est.num_replicas == 8 and jax.process_count() == 1
    assert est.config.cluster is config.cluster  # the choice is kept as given


def test_one_worker_or_no_environment_is_one_process(monkeypatch, backend_started):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert cluster_lib.start_cluster(None, model_dir=None) is None
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["h:1"]}, "task": {}}))
    assert cluster_lib.from_environment() is None
    assert cluster_lib.start_cluster(None, model_dir=None) is None


class _DetectedJob:
    """Stands in for one of JAX's ClusterEnv classes (a TPU slice, Slurm, ...)."""

    opt_in_only_method = False
    processes = 1

    @classmethod
    def is_env_present(cls):
        return True

    @classmethod
    def get_process_count(cls):
        return cls.processes


@pytest.mark.parametrize("processes, joins", [(1, False), (4, True)])
def test_a_detected_job_is_joined_when_it_has_more_than_one_process(monkeypatch, processes, joins):
    """A one-host TPU VM is detected as a TPU cluster: nothing to join there."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv(cluster_lib.NO_CLUSTER_ENV, raising=False)
    monkeypatch.setattr(_DetectedJob, "processes", processes)
    monkeypatch.setattr(cluster_lib._compat, "jax_cluster_types", lambda: [_DetectedJob])
    resolver = cluster_lib.from_environment()
    assert (resolver is not None) == joins
    if joins:
        assert resolver.mode == "auto" and resolver.source == "_DetectedJob"


def test_a_cluster_that_cannot_connect_is_refused_by_run_config():
    with pytest.raises(TypeError, match=r"None \(the job TF_CONFIG .*\) or False"):
        estimator.RunConfig(cluster="grpc://10.0.0.1:8470")
    with pytest.raises(TypeError, match="RunConfig.cluster must be"):
        estimator.RunConfig(cluster=True)


# ----------------------------------------------------------------------------- end to end
def _launch_tf_style_script(model_dir: str, out_dir: str) -> tuple[Any, float]:
    """``python -m estimator.cluster.launch --num_processes 2 -- _tf_style_job.py ...``, as a
    user runs it; the script names no cluster."""
    unset = ("TF_CONFIG", cluster_lib.NO_CLUSTER_ENV)
    env = {k: v for k, v in os.environ.items() if k not in unset}
    command = [sys.executable, "-m", "estimator.cluster.launch", "--num_processes", "2"]
    command += ["--timeout", "150", "--", job.__file__, model_dir, out_dir, "--evaluate"]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    return done, time.monotonic() - start


def test_a_tf_style_script_under_the_launcher_trains_one_job(tmp_path):
    """Two processes of one job: the same steps, the same evaluation, one set of
    checkpoints and one event file (process 0's), and the launcher exits 0."""
    model_dir, out_dir = str(tmp_path / "model"), str(tmp_path / "out")
    os.makedirs(out_dir)
    done, secs = _launch_tf_style_script(model_dir, out_dir)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "ModelDirInUseError" not in output and "Joining a 2-process job" in output
    assert "Gloo" not in output and "peer ranks" not in output  # its connect notices dropped
    p0, p1 = (json.loads((tmp_path / "out" / f"process_{i}.json").read_text()) for i in (0, 1))
    for i, p in enumerate((p0, p1)):
        assert (p["process_index"], p["process_count"], p["devices"]) == (i, 2, [4, 8])
        assert p["final_step"] == 6
    assert p0["eval"] == p1["eval"] and p0["eval"]["global_step"] == 6
    names = sorted(os.listdir(model_dir))
    events = [n for n in names if n.startswith("events.out.tfevents.")]
    assert [n for n in names if "ckpt" in n] == ["model.ckpt-4", "model.ckpt-6"]  # no tmp
    assert [int(n.split(".")[-2]) for n in events] == [p0["pid"]]
    assert secs < 120, f"took {secs:.0f} s"
