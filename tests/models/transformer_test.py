"""The Transformer LM: causal, learns its text through the estimator, reports perplexity."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hooks
from models import transformer
from tests.configs._jobs import build_job


def test_logits_do_not_see_the_future():
    model = transformer.TransformerLM(num_layers=2, num_heads=2, d_model=16, mlp_dim=32, max_len=12)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 256, (2, 12)), jnp.int32)
    variables = model.init(jax.random.key(0), tokens, train=False)
    changed = tokens.at[:, 7:].set((tokens[:, 7:] + 1) % 256)
    a = model.apply(variables, tokens, train=False)
    b = model.apply(variables, changed, train=False)
    assert a.shape == (2, 12, 256)
    np.testing.assert_allclose(a[:, :7], b[:, :7], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 7:], b[:, 7:])
    with pytest.raises(ValueError, match="max_len=12"):
        model.apply(variables, jnp.zeros((1, 13), jnp.int32), train=False)


def test_perplexity_metric_is_exp_of_the_mean_token_loss_over_all_batches():
    a, b = np.log([[2.0, 8.0]]), np.log([[4.0, 4.0], [1.0, 16.0]])
    merged = transformer.Perplexity.from_model_output(a).merge(
        transformer.Perplexity.from_model_output(b)
    )
    assert merged.compute() == pytest.approx(math.exp(np.concatenate([a, b]).mean()))
    assert merged.compute() == pytest.approx(4.0)


class _Losses(hooks.SessionRunHook):
    def __init__(self):
        self.losses = []

    def before_run(self, run_context):
        return hooks.SessionRunArgs("loss")

    def after_run(self, run_context, run_values):
        self.losses.extend(np.ravel(run_values.results).tolist())


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_loss_decreases_on_its_text_and_eval_reports_perplexity(tmp_path):
    est, fns, config = build_job(
        "transformer_lm",
        tmp_path,
        seq_len=32,
        eval_fraction=0.005,
        train_batch_size=32,
        eval_batch_size=16,
        predict_batch_size=16,
        iterations_per_loop=80,
        log_step_count_steps=0,
        save_summary_steps=0,
        save_checkpoints_steps=1000,
        **{
            "model_params.max_len": 32,
            "model_params.d_model": 64,
            "model_params.mlp_dim": 128,
            "model_params.num_layers": 2,
            "model_params.warmup_steps": 10,
            "model_params.decay_steps": 80,
            "model_params.learning_rate": 3e-3,
        },
    )
    assert config.text_source == "python_reference"
    losses = _Losses()
    est.train(fns["train"], max_steps=80, hooks=[losses])
    assert len(losses.losses) == 80
    assert losses.losses[0] == pytest.approx(math.log(256), abs=0.3)  # uniform over bytes
    first, last = np.mean(losses.losses[:10]), np.mean(losses.losses[-10:])
    assert last < first - 1.0 and last < math.log(256) - 1.5, (first, last)

    results = est.evaluate(fns["eval"])
    assert results["global_step"] == 80
    assert 1.0 < results["perplexity"] < 40.0  # a uniform guess over bytes gives 256
    assert results["perplexity"] == pytest.approx(math.exp(results["loss"]), rel=1e-4)

    # Independent reference: perplexity from the predicted logits, in numpy, over every
    # held-out window (the eval set does not fill the last global batch: padding removed).
    windows = [(f, y) for f, y in fns["eval"]({"batch_size": 1000})]
    labels = np.concatenate([y for _, y in windows])
    assert len(labels) % 16 != 0
    preds = list(est.predict(fns["predict"], yield_single_examples=False))
    logits = np.concatenate([p["logits"] for p in preds])
    assert logits.shape == (*labels.shape, 256)
    nll = -np.take_along_axis(_log_softmax(logits.astype(np.float64)), labels[..., None], -1)
    assert results["perplexity"] == pytest.approx(math.exp(nll.mean()), rel=1e-4)
    accuracy = np.mean(np.concatenate([p["next_token"] for p in preds]) == labels)
    assert results["accuracy"] == pytest.approx(accuracy, abs=1e-6)
