"""params and the final evaluation metrics in TensorBoard's HPARAMS tab, read back by the
hparams plugin's own handlers (as the TensorBoard UI reads them)."""

from __future__ import annotations

import numpy as np
import optax

from estimator.driver import hparams
from tests import helpers as h
from tests.estimator.driver import tb_reader


def test_hparam_values_keep_scalars_strings_and_bools():
    params = {
        "lr": 0.1,
        "layers": 3,
        "opt": "adam",
        "bn": False,
        "np": np.float32(0.5),
        "nested": {"a": 1},
        "sizes": [1, 2],
        "none": None,
        "fn": len,
    }
    assert hparams.hparam_values(params) == {
        "lr": 0.1,
        "layers": 3.0,
        "opt": "adam",
        "bn": False,
        "np": 0.5,
    }


def test_a_sweep_compares_in_the_hparams_tab(tmp_path):
    x, y = h.make_data(n=32)
    results = {}
    for lr in (0.05, 0.5):
        run = f"lr{lr}"
        params = {"lr": lr, "hidden": 8, "optimizer": "sgd", "batch_norm": False, "tags": ["x"]}
        est = h.make_estimator(tmp_path / run, params=params, ipl=2, save_summary_steps=100)
        est.train(h.train_input_fn(x, y), max_steps=2)
        est.train(h.train_input_fn(x, y), max_steps=4)  # a second call: no second session
        results[run] = est.evaluate(h.eval_input_fn(x, y))
    infos, sessions = tb_reader.hparams_tab(tmp_path)
    assert infos == {
        "lr": "DATA_TYPE_FLOAT64",
        "hidden": "DATA_TYPE_FLOAT64",
        "optimizer": "DATA_TYPE_STRING",
        "batch_norm": "DATA_TYPE_BOOL",
        **{name: "DATA_TYPE_FLOAT64" for name in _TRAINER_NUMBERS},
        "compute_dtype": "DATA_TYPE_STRING",
    }
    assert sorted(sessions) == ["lr0.05", "lr0.5"]
    for run, (values, metrics) in sessions.items():
        expected = {"lr": float(run[2:]), "hidden": 8.0, "optimizer": "sgd", "batch_norm": False}
        trainer = {"train_batch_size": 16.0, "compute_dtype": "float32", "num_microbatches": 1.0}
        trainer.update(iterations_per_loop=2.0, max_steps=2.0)  # the first call's
        assert values == {**expected, **trainer}
        for name in ("accuracy", "loss"):  # the final evaluation, as evaluate returned it
            assert metrics[("eval", name)] == np.float32(results[run][name])
    mux = tb_reader.multiplexer(tmp_path)
    starts = mux.PluginRunToTagToContent("hparams")
    assert sorted(starts) == ["lr0.05", "lr0.5"]  # model_dir only, never eval/
    assert len(mux.Tensors("lr0.5", hparams.SESSION_START_TAG)) == 1


_TRAINER_NUMBERS = ("train_batch_size", "num_microbatches", "iterations_per_loop", "max_steps")


def _adam_model_fn(features, labels, mode, params):
    spec = h.model_fn(features, labels, mode, params)
    if mode == "train":
        spec.train_op = optax.adamw(optax.cosine_decay_schedule(0.01, 100))
    return spec


def test_the_trainers_settings_are_in_the_hparams_tab(tmp_path):
    """Issue 42: HPARAMS held only the model's params, not how it was trained."""
    x, y = h.make_data(n=32)
    est = h.make_estimator(
        tmp_path / "run",
        _adam_model_fn,
        params={"hidden": 8},
        ipl=2,
        save_summary_steps=100,
        tpu={"compute_dtype": "bfloat16", "num_microbatches": 2},
    )
    est.train(h.train_input_fn(x, y), max_steps=4)
    _, sessions = tb_reader.hparams_tab(tmp_path)
    values, _ = sessions["run"]
    assert values == {
        "hidden": 8.0,
        "train_batch_size": 16.0,
        "compute_dtype": "bfloat16",
        "num_microbatches": 2.0,
        "iterations_per_loop": 2.0,
        "max_steps": 4.0,
        "optimizer": "adam+add_decayed_weights",
    }


def test_no_session_when_summaries_are_off(tmp_path):
    x, y = h.make_data(n=32)
    est = h.make_estimator(tmp_path, params={"lr": 0.1}, ipl=2, save_summary_steps=0)
    est.train(h.train_input_fn(x, y), max_steps=2)
    assert tb_reader.multiplexer(tmp_path).PluginRunToTagToContent("hparams") == {}
