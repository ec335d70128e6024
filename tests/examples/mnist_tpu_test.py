"""The ported Cloud TPU MNIST program runs end to end: 8 replicas, and one device."""

from __future__ import annotations

import logging

import jax
import pytest

from tests.examples._load import example

TRAIN_STEPS = 40


@pytest.fixture
def optimized():
    """XLA's optimisations on: the conv steps run ~3x faster, which outweighs their compile."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


def _run(model_dir, *, use_tpu: bool):
    module = example("mnist_tpu")
    flags = module.FLAGS
    flags.unparse_flags()
    flags(
        [
            "mnist_tpu",
            f"--model_dir={model_dir}",
            "--batch_size=32",
            f"--train_steps={TRAIN_STEPS}",
            "--eval_steps=2",
            "--iterations=5",
            "--learning_rate=0.1",
            f"--use_tpu={'true' if use_tpu else 'false'}",
        ]
    )
    try:
        return module.main([])
    finally:
        flags.unparse_flags()


@pytest.mark.parametrize("use_tpu", [True, False])
def test_mnist_port_trains_evaluates_and_predicts(tmp_path, use_tpu, caplog, optimized):
    with caplog.at_level(logging.INFO):
        results, predicted = _run(tmp_path, use_tpu=use_tpu)
    assert results["global_step"] == TRAIN_STEPS
    assert results["accuracy"] > 0.5, results  # 10 classes; 40 steps of 32 examples
    assert len(predicted) == 10 and all(0 <= c < 10 for c in predicted)
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith('Prediction is "') for m in messages) == 10
    # The TF-only session_config is accepted, with one warning naming it.
    assert sum("session_config ignored" in m for m in messages) == 1, messages
    assert (tmp_path / f"model.ckpt-{TRAIN_STEPS}").is_dir()
