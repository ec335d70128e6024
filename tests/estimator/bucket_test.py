"""model_dir on a bucket, as a Cloud TPU user keeps it: every operation against a real GCS
emulator (fake-gcs-server on 127.0.0.1, started by the ``gcs_url`` fixture), compared with the
same job on a local disk, and nothing ever written to a local folder named ``gs:``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import estimator
from estimator import storage
from estimator.cli import app as cli
from hooks import event_reader
from tests import helpers
from tests.estimator.driver.training_resume_test import _assert_bitwise_equal, _read_step

ROOT = Path(__file__).resolve().parents[2]
X, Y = helpers.make_data(n=96)
STEPS = 12


def _est(model_dir, **kw):
    kw.setdefault("save_checkpoints_steps", 4)
    kw.setdefault("keep_checkpoint_max", 2)
    kw.setdefault("save_summary_steps", 4)
    return helpers.make_estimator(model_dir, **kw)


def _train(model_dir, **kw):
    est = _est(model_dir, **kw)
    est.train(helpers.train_input_fn(X, Y), max_steps=STEPS)
    return est


@pytest.fixture(scope="module")
def trained(tmp_path_factory, request):
    """The same job trained on a bucket and on a local disk, from a working directory that
    would show any stray local ``gs:`` folder."""
    cwd = tmp_path_factory.mktemp("cwd")
    from tests import gcs_emulator as emulator

    url = emulator.new_bucket(request.getfixturevalue("gcs_emulator")) + "/run"
    old = os.getcwd()
    os.chdir(cwd)
    try:
        bucket = _train(url)
        local = _train(tmp_path_factory.mktemp("local"))
    finally:
        os.chdir(old)
    return {"url": url, "bucket": bucket, "local": local, "cwd": cwd}


def _objects(url: str) -> list[str]:
    from etils import epath

    root = epath.Path(url)
    return sorted(str(p)[len(url) + 1 :] for p in root.rglob("*") if not p.is_dir())


def test_training_writes_everything_to_the_bucket_and_nothing_locally(trained):
    url = trained["url"]
    assert list(trained["cwd"].iterdir()) == []  # no local gs: folder, no lock, no events
    names = storage.listdir(url)
    assert sorted(n for n in names if n.startswith("model.ckpt-")) == [
        "model.ckpt-12",
        "model.ckpt-8",
    ]  # rotated: keep_checkpoint_max=2
    assert any(n.startswith("events.out.tfevents") for n in names)
    assert storage.finished_step(storage.join(url, "model.ckpt-12"))


def test_the_bucket_run_equals_the_local_run(trained):
    bucket, local = trained["bucket"], trained["local"]
    assert bucket.latest_checkpoint() == storage.join(trained["url"], "model.ckpt-12")
    assert estimator.latest_checkpoint(trained["url"]) == bucket.latest_checkpoint()
    assert bucket.get_variable_names() == local.get_variable_names()
    for name in local.get_variable_names():
        want = local.get_variable_value(name)
        np.testing.assert_array_equal(bucket.get_variable_value(name), want)
    want = dict(estimator.list_variables(local.model_dir))
    assert dict(estimator.list_variables(trained["url"])) == want
    kernel = estimator.load_variable(trained["url"], "hidden/kernel")
    np.testing.assert_array_equal(kernel, local.get_variable_value("hidden/kernel"))


def test_evaluate_and_predict_from_the_bucket(trained):
    bucket, local = trained["bucket"], trained["local"]
    got = bucket.evaluate(helpers.eval_input_fn(X, Y))
    want = local.evaluate(helpers.eval_input_fn(X, Y))
    assert got == want and got["global_step"] == STEPS
    fresh = _est(trained["url"])  # a new estimator reads the bucket's checkpoint
    p_bucket = [p["logits"] for p in fresh.predict(helpers.eval_input_fn(X))]
    p_local = [p["logits"] for p in local.predict(helpers.eval_input_fn(X))]
    np.testing.assert_array_equal(np.stack(p_bucket), np.stack(p_local))


def test_checkpoints_iterator_and_the_eval_events_readers(trained):
    url = trained["url"]
    seen = list(estimator.checkpoints_iterator(url, timeout=0))
    assert seen == [storage.join(url, "model.ckpt-12")]
    trained["bucket"].evaluate(helpers.eval_input_fn(X, Y), name="readers")
    metrics = event_reader.read_eval_metrics(storage.join(url, "eval_readers"))
    assert list(metrics) == [STEPS] and "accuracy" in metrics[STEPS]


def test_training_events_read_by_tensorboard(trained):
    from tensorboard.backend.event_processing import event_accumulator as ea

    with storage.local_copy(trained["url"]) as copy:
        acc = ea.EventAccumulator(copy, size_guidance={ea.SCALARS: 0})
        acc.Reload()
        steps = [s.step for s in acc.Scalars("loss")]
    assert steps and steps[-1] == STEPS


def _serving_fn():
    return estimator.build_raw_serving_input_receiver_fn(
        {"x": np.zeros((1, X.shape[1]), np.float32)}
    )


def test_export_to_and_load_from_the_bucket(trained):
    base = storage.join(trained["url"], "export")
    path = trained["bucket"].export_saved_model(base, _serving_fn())
    assert path.startswith(base + "/") and storage.finished_step(path)
    for model in (estimator.load_saved_model(path), estimator.load_saved_model(base)):
        out = model({"x": X[:5]})
        want = [p["logits"] for p in trained["local"].predict(helpers.eval_input_fn(X[:5]))]
        np.testing.assert_allclose(out["logits"], np.stack(want), rtol=1e-6, atol=1e-6)
    assert list(trained["cwd"].iterdir()) == []


def test_a_half_written_step_on_a_bucket_is_not_taken(trained, gcs_url):
    """Orbax on GCS writes the final step name at once: without its commit marker a step
    is unfinished, however complete it looks."""
    for name in storage.listdir(trained["url"]):
        if name == "model.ckpt-12":
            src = storage.join(trained["url"], name)
            with storage.local_copy(src) as local:
                storage.upload_tree(local, storage.join(gcs_url, name))
    half = storage.join(gcs_url, "model.ckpt-16")
    with storage.local_copy(storage.join(trained["url"], "model.ckpt-12")) as local:
        os.remove(os.path.join(local, storage.COMMIT_FILE))
        storage.upload_tree(local, half)
    assert estimator.latest_checkpoint(gcs_url) == storage.join(gcs_url, "model.ckpt-12")
    assert list(estimator.checkpoints_iterator(gcs_url, timeout=0)) == [
        storage.join(gcs_url, "model.ckpt-12")
    ]


def test_a_bucket_seeded_with_local_checkpoints_resumes(trained, gcs_url):
    storage.upload_tree(trained["local"].model_dir, gcs_url)
    est = _est(gcs_url)
    assert est.evaluate(helpers.eval_input_fn(X, Y)) == trained["local"].evaluate(
        helpers.eval_input_fn(X, Y)
    )
    est.train(helpers.train_input_fn(X, Y), max_steps=STEPS + 4)
    assert est.latest_checkpoint() == storage.join(gcs_url, f"model.ckpt-{STEPS + 4}")


def test_a_second_trainer_on_the_same_bucket_is_refused(trained, gcs_url):
    from estimator.io import lease

    holder = lease.for_model_dir(gcs_url)
    holder.acquire()
    try:
        with pytest.raises(estimator.ModelDirInUseError, match="in use by another trainer"):
            _train(gcs_url)
    finally:
        holder.release()
    assert _train(gcs_url).latest_checkpoint().endswith(f"model.ckpt-{STEPS}")


def test_the_cli_on_a_bucket(gcs_url, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["--config", "digits_mlp_small", "--model_dir", gcs_url]
    assert cli.main(["train", *args]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["model_dir"] == gcs_url and trained["global_step"] > 0
    assert cli.main(["evaluate", *args]) == 0
    assert json.loads(capsys.readouterr().out)["global_step"] == trained["global_step"]
    assert cli.main(["predict", *args]) == 0
    predicted = json.loads(capsys.readouterr().out)
    assert predicted["output"] == storage.join(gcs_url, "predictions.jsonl")
    lines = storage.read_text(predicted["output"]).splitlines()
    assert len(lines) == predicted["num_predictions"] > 0
    assert cli.main(["export", *args]) == 0
    exported = json.loads(capsys.readouterr().out)["export_dir"]
    assert exported.startswith(storage.join(gcs_url, "export")) and storage.finished_step(exported)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ killed and resumed
def _job(model_dir: str, *extra: str, timeout: float = 240) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.estimator._train_job", model_dir, *extra],
        cwd=tempfile.mkdtemp(),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _final_arrays(model_dir: str, step: int) -> dict:
    """Every array (and the meta) of a checkpoint, read with Orbax directly."""
    return _read_step(storage.epath_of(model_dir), step)


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_sigkill_mid_save_on_a_bucket_resumes_bitwise(gcs_url, tmp_path):
    args = ("--max_steps", "24", "--save_steps", "4", "--sleep", "0.02")
    args += ("--cache", str(tmp_path / "cache"))
    reference = _job(storage.join(gcs_url, "reference"), *args)
    killed_dir = storage.join(gcs_url, "killed")
    job = _job(killed_dir, *args)
    seen = []
    for line in job.stdout:  # SIGKILL on the log line: the step is still being written
        seen.append(line)
        if line.startswith("Saving checkpoints for 12 "):
            job.kill()
            break
    job.wait(timeout=120)
    assert job.returncode == -9, seen[-10:]
    out, _ = _job(killed_dir, *args).communicate(timeout=240)
    assert "DONE 24" in out, out[-3000:]
    ref_out, _ = reference.communicate(timeout=240)
    assert "DONE 24" in ref_out, ref_out[-3000:]
    got, want = _final_arrays(killed_dir, 24), _final_arrays(storage.join(gcs_url, "reference"), 24)
    _assert_bitwise_equal(got, want, "killed during the save of step 12 on a bucket")
