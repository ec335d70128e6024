"""The ported EfficientNet main runs end to end: train_and_eval, eval over checkpoints with the
best export in place of archive_ckpt, and the final export, on 8 replicas."""

from __future__ import annotations

import json
import logging
import os

import numpy as np

import estimator
from hooks import event_reader
from tests.examples._load import example

TRAIN_STEPS = 10


def _run(*args):
    module = example("efficientnet_tpu")
    flags = module.FLAGS
    flags.unparse_flags()
    flags(
        [
            "efficientnet_tpu",
            "--train_batch_size=32",
            "--eval_batch_size=32",
            "--iterations_per_loop=5",
            "--num_eval_images=64",
            *args,
        ]
    )
    try:
        return module.main([])
    finally:
        flags.unparse_flags()


def _exported_step(path: str) -> int:
    with open(os.path.join(path, "assets.extra", "signature.json")) as f:
        return json.load(f)["global_step"]


def test_efficientnet_port_trains_evaluates_keeps_the_best_and_exports(tmp_path, caplog):
    model_dir = str(tmp_path / "run")
    with caplog.at_level(logging.INFO):
        est, results, _ = _run(
            f"--model_dir={model_dir}", f"--train_steps={TRAIN_STEPS}", "--steps_per_eval=5"
        )
        assert results["global_step"] == TRAIN_STEPS
        # eval mode: the newest checkpoint is evaluated and the job ends at train_steps.
        _, eval_results, exported = _run(
            f"--model_dir={model_dir}",
            f"--train_steps={TRAIN_STEPS}",
            "--mode=eval",
            "--eval_timeout=1",
            f"--export_dir={tmp_path / 'export'}",
        )
    assert eval_results["global_step"] == TRAIN_STEPS
    # The moving averages of the weights and of BatchNorm's statistics (utils.get_ema_vars),
    # which evaluation reads through Saver(ema.variables_to_restore(ema_vars)).
    names = est.get_variable_names()
    assert "stem_conv/kernel/ExponentialMovingAverage" in names
    assert "batch_stats/batch_normalization/var/ExponentialMovingAverage" in names
    messages = [r.getMessage() for r in caplog.records]
    assert sum("session_config ignored" in m for m in messages) == 2  # once per run
    assert any("TPUEstimator(export_to_tpu=False) ignored" in m for m in messages)
    # The weight decay and host_call summaries ran: learning_rate is in model_dir's events.
    written = event_reader.read_eval_metrics(model_dir)
    assert any("learning_rate" in v for v in written.values())
    # The best export is the evaluation with the highest top-1 accuracy (archive_ckpt's rule).
    evaluations = event_reader.read_eval_metrics(est.eval_dir())
    best_dir = os.path.join(model_dir, "export", "best")
    (version,) = os.listdir(best_dir)
    best_top1 = max(v["top_1_accuracy"] for v in evaluations.values())
    step = _exported_step(os.path.join(best_dir, version))
    assert evaluations[step]["top_1_accuracy"] == best_top1
    # The final export serves what predict computes.
    images, _ = example("efficientnet_tpu").dataset("validation")
    served = estimator.load_saved_model(exported)(images[:16])["probabilities"]
    assert served.shape == (16, 10)
    np.testing.assert_allclose(served.sum(-1), 1.0, rtol=1e-5)
