"""BestExporter, LatestExporter, FinalExporter in ``EvalSpec(exporters=...)`` (issue 27,
item 5), as the TF programs write them; every export is checked against the evaluation
results TensorBoard's event files hold (an independent record)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
from hooks import event_reader
from tests import helpers as h

X, Y = h.make_data(n=64, d=6, classes=3, seed=11)
SERVING = estimator.build_raw_serving_input_receiver_fn({"x": np.zeros((1, 6), np.float32)})


def model_fn(features, labels, mode, params):
    """The helpers' MLP, trained downhill for 4 steps and uphill after (the learning rate
    turns negative), so the best evaluation is not the last one."""
    spec = h.model_fn(features, labels, mode, params)
    if mode != estimator.ModeKeys.TRAIN:
        return spec

    def lr(step):
        return jnp.where(step < 4, 0.5, -1.0)

    return estimator.TPUEstimatorSpec(mode, loss=spec.loss, train_op=optax.sgd(lr))


def _version_steps(export_path: str) -> dict[int, int]:
    """{version: global step of the checkpoint exported} for one exporter's directory."""
    out = {}
    for version in sorted(os.listdir(export_path)):
        with open(os.path.join(export_path, version, "assets.extra", "signature.json")) as f:
            out[int(version)] = json.load(f)["global_step"]
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("exporters")
    asset = model_dir.parent / "vocab.txt"
    asset.write_text("a\nb\n")
    est = h.make_estimator(model_dir, model_fn, ipl=2, save_checkpoints_steps=2)
    exporters = [
        estimator.BestExporter(
            name="best",
            serving_input_receiver_fn=SERVING,
            exports_to_keep=1,
            assets_extra={"vocab.txt": str(asset)},
        ),
        estimator.LatestExporter("latest", SERVING, exports_to_keep=2),
        estimator.FinalExporter("final", SERVING),
    ]
    result, export_results = estimator.train_and_evaluate(
        est,
        estimator.TrainSpec(h.train_input_fn(X, Y), max_steps=8),
        estimator.EvalSpec(h.eval_input_fn(X, Y), steps=None, throttle_secs=0, exporters=exporters),
    )
    evaluations = event_reader.read_eval_metrics(est.eval_dir())
    return est, result, export_results, evaluations


def test_best_exporter_keeps_the_lowest_loss_evaluation(run):
    est, _, _, evaluations = run
    assert sorted(evaluations) == [2, 4, 6, 8]
    best_step = min(evaluations, key=lambda s: evaluations[s]["loss"])
    assert best_step != 8  # the setup's point: the best is not simply the newest
    best = _version_steps(os.path.join(est.model_dir, "export", "best"))
    assert list(best.values()) == [best_step]  # exports_to_keep=1
    (version,) = best
    path = os.path.join(est.model_dir, "export", "best", str(version))
    with open(os.path.join(path, "assets.extra", "vocab.txt")) as f:
        assert f.read() == "a\nb\n"
    # The export serves the weights of that evaluation: its loss is the evaluation's.
    logits = estimator.load_saved_model(path)({"x": X})["logits"]
    z = logits - logits.max(-1, keepdims=True)
    loss = -(z - np.log(np.exp(z).sum(-1, keepdims=True)))[np.arange(len(Y)), Y].mean()
    assert loss == pytest.approx(evaluations[best_step]["loss"], rel=1e-4)


def test_latest_and_final_exporters(run):
    est, result, export_results, _ = run
    latest = _version_steps(os.path.join(est.model_dir, "export", "latest"))
    assert list(latest.values()) == [6, 8]  # exports_to_keep=2 of 2, 4, 6, 8
    final = _version_steps(os.path.join(est.model_dir, "export", "final"))
    assert list(final.values()) == [8]
    assert result["global_step"] == 8
    # TF's export results: each exporter's result after the last evaluation.
    best, latest_path, final_path = export_results
    assert best is None  # step 8 was not an improvement
    assert os.path.basename(latest_path) == str(max(latest))
    assert os.path.basename(final_path) == str(max(final))


def test_a_restarted_best_exporter_starts_from_the_event_files(run, tmp_path):
    """A new BestExporter (a restarted job) knows the best evaluation already recorded."""
    est, _, _, evaluations = run
    best_loss = min(v["loss"] for v in evaluations.values())
    exporter = estimator.BestExporter(name="again", serving_input_receiver_fn=SERVING)
    path = str(tmp_path / "again")
    worse = {"loss": best_loss + 1.0, "global_step": 10}
    assert exporter.export(est, path, None, worse, False) is None
    better = {"loss": best_loss - 1.0, "global_step": 10}
    assert exporter.export(est, path, None, better, False).startswith(path)


def test_an_exporter_that_cannot_run_fails_loudly(tmp_path):
    def broken():
        raise OSError("no vocabulary file")

    est = h.make_estimator(tmp_path, model_fn, ipl=2, save_checkpoints_steps=2)
    spec = estimator.EvalSpec(
        h.eval_input_fn(X, Y),
        steps=1,
        throttle_secs=0,
        exporters=estimator.LatestExporter("latest", broken),
    )
    with pytest.raises(OSError, match="no vocabulary file"):
        estimator.train_and_evaluate(
            est, estimator.TrainSpec(h.train_input_fn(X, Y), max_steps=2), spec
        )


def test_tfs_argument_checks():
    with pytest.raises(TypeError, match="serving_input_receiver_fn"):
        estimator.BestExporter(name="best")
    with pytest.raises(ValueError, match="positive"):
        estimator.LatestExporter("latest", SERVING, exports_to_keep=0)
    with pytest.raises(ValueError, match="best_eval_result"):
        estimator.BestExporter("b", SERVING, compare_fn=lambda a, b: True)
    with pytest.raises(ValueError, match="unique"):
        estimator.EvalSpec(
            h.eval_input_fn(X, Y),
            exporters=[
                estimator.LatestExporter("x", SERVING),
                estimator.FinalExporter("x", SERVING),
            ],
        )
    with pytest.raises(TypeError, match="Exporter"):
        estimator.EvalSpec(h.eval_input_fn(X, Y), exporters=["best"])
    with pytest.raises(ValueError, match="no loss"):
        estimator.exporters._loss_smaller({"accuracy": 1.0}, {"loss": 0.1})


def test_a_custom_compare_fn(tmp_path, run):
    """TF's compare_fn signature: higher accuracy wins."""
    est, _, _, _ = run

    def higher_accuracy(best_eval_result, current_eval_result):
        return current_eval_result["accuracy"] > best_eval_result["accuracy"]

    exporter = estimator.BestExporter(
        "acc", SERVING, event_file_pattern=None, compare_fn=higher_accuracy
    )
    path = str(tmp_path / "acc")
    assert exporter.export(est, path, None, {"accuracy": 0.5}, False)
    assert exporter.export(est, path, None, {"accuracy": 0.4}, False) is None
    assert exporter.export(est, path, None, {"accuracy": 0.6}, False)
