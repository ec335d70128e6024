"""The ported Cloud TPU MNIST program runs end to end: 8 replicas, and one device."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from examples import mnist_tpu

TRAIN_STEPS = 60


def _run(model_dir, *, use_tpu: bool):
    flags = mnist_tpu.FLAGS
    flags.unparse_flags()
    flags(
        [
            "mnist_tpu",
            f"--model_dir={model_dir}",
            "--batch_size=128",
            f"--train_steps={TRAIN_STEPS}",
            "--eval_steps=2",
            "--iterations=20",
            f"--use_tpu={'true' if use_tpu else 'false'}",
        ]
    )
    try:
        return mnist_tpu.main([])
    finally:
        flags.unparse_flags()


@pytest.mark.parametrize("use_tpu", [True, False])
def test_mnist_port_trains_evaluates_and_predicts(tmp_path, use_tpu, caplog):
    with caplog.at_level(logging.INFO):
        results, predicted = _run(tmp_path, use_tpu=use_tpu)
    assert results["global_step"] == TRAIN_STEPS
    assert results["accuracy"] > 0.8, results
    _, labels = mnist_tpu.dataset("test")
    assert len(predicted) == 10
    assert np.mean(np.array(predicted) == labels[:10]) >= 0.7
    assert sum('Prediction is "' in r.getMessage() for r in caplog.records) == 10
    ignored = [r.getMessage() for r in caplog.records if "session_config" in r.getMessage()]
    assert len(ignored) == 1  # the TF-only argument is accepted, with one warning
