"""Every config in configs/ trains, evaluates and predicts on 8 replicas, shrunk by overrides."""

import math

import numpy as np
import pytest

from tests.configs._jobs import build_job, config_names, count_examples

_COMMON = {"save_checkpoints_steps": 2, "log_step_count_steps": 0, "save_summary_steps": 0}
# Two steps in one device loop (max_steps == iterations_per_loop): one train compile.
_TWO_STEPS = {"max_steps": 2, "iterations_per_loop": 2}
_IMAGES = {
    **_TWO_STEPS,
    "image_size": (16, 16, 3),
    "num_train_examples": 32,
    "num_eval_examples": 20,
    "train_batch_size": 16,
    "eval_batch_size": 16,
    "predict_batch_size": 16,
    "model_params.num_filters": 4,
    # One block per stage: every stage transition (strided, projected shortcut) of the same
    # block type in a graph that compiles quickly. Full depths: resnet_test.py's counts.
    "model_params.stage_sizes": (1, 1, 1, 1),
    "unroll_loops": False,
}

# What each config is shrunk to; a config missing here fails test_every_config_is_covered.
SHRINK = {
    "digits_mlp": {**_TWO_STEPS, "model_params.hidden": (16,)},
    "digits_mlp_small": _TWO_STEPS,
    "digits_cnn": {**_TWO_STEPS, "model_params.features": (4, 8), "model_params.dense": 16},
    "resnet18_cifar_synthetic": _IMAGES,
    "resnet50_imagenet_synthetic": {**_IMAGES, "image_size": (32, 32, 3)},
    "transformer_lm": {
        **_TWO_STEPS,
        "text_source": "zen",
        "seq_len": 16,
        "model_params.max_len": 16,
        "model_params.d_model": 32,
        "model_params.mlp_dim": 64,
        "model_params.num_layers": 2,
        "train_batch_size": 16,
        "eval_batch_size": 16,
        "predict_batch_size": 16,
    },
}
# Convolution-heavy graphs are compile-bound here: compile them with optimizations off.
_FAST_COMPILE = {"resnet18_cifar_synthetic", "resnet50_imagenet_synthetic"}


def test_every_config_is_covered():
    assert sorted(SHRINK) == config_names()


@pytest.mark.parametrize("name", sorted(SHRINK))
def test_config_trains_evaluates_and_predicts_on_8_replicas(name, tmp_path, request):
    if name in _FAST_COMPILE:
        request.getfixturevalue("fast_compile")
    overrides = dict(_COMMON, **SHRINK[name])
    est, input_fns, config = build_job(name, tmp_path, **overrides)
    assert est.num_replicas == 8

    est.train(input_fns["train"], max_steps=config.max_steps)
    assert est.get_variable_value("global_step") == config.max_steps

    results = est.evaluate(input_fns["eval"], steps=config.eval_steps or None)
    assert results["global_step"] == config.max_steps
    assert math.isfinite(results["loss"])
    assert config.target_metric in results
    assert math.isfinite(results[config.target_metric])

    predictions = list(est.predict(input_fns["predict"]))
    assert len(predictions) == count_examples(input_fns["predict"], config.predict_batch_size)
    first = predictions[0]
    label_shape = np.shape(next(iter(input_fns["eval"]({"batch_size": 1})))[1][0])
    key = "next_token" if "next_token" in first else "class_ids"
    assert np.shape(first[key]) == label_shape


_FEATURES = {
    "compute_dtype": "bfloat16",
    "num_microbatches": 2,
    "model_params.moving_average_decay": 0.9,
}


@pytest.mark.parametrize("name", ["resnet18_cifar_synthetic", "transformer_lm"])
def test_trainer_features_together_on_the_zoo(name, tmp_path, request, caplog):
    """bf16 compute, micro-batches and moving averages on BatchNorm (ResNet) and attention
    (the LM): every stored variable stays float32 and evaluate reads the averages."""
    if name in _FAST_COMPILE:
        request.getfixturevalue("fast_compile")
    est, input_fns, config = build_job(name, tmp_path, **_COMMON, **SHRINK[name], **_FEATURES)
    est.train(input_fns["train"], max_steps=config.max_steps)
    names = est.get_variable_names()
    assert any(n.endswith("/ExponentialMovingAverage") for n in names)
    stats = [n for n in names if "batch_stats" in n or n.endswith(("/mean", "/var"))]
    assert name != "resnet18_cifar_synthetic" or stats  # BatchNorm's statistics are there
    floats = {n: est.get_variable_value(n) for n in names if n != "global_step"}
    wide = {n: v.dtype for n, v in floats.items() if np.issubdtype(v.dtype, np.floating)}
    assert wide and set(wide.values()) == {np.dtype(np.float32)}, wide
    assert all(np.isfinite(v).all() for v in floats.values() if v.dtype.kind == "f")
    with caplog.at_level("INFO", logger="estimator"):
        results = est.evaluate(input_fns["eval"], steps=config.eval_steps or None)
    assert math.isfinite(results["loss"]) and math.isfinite(results[config.target_metric])
    assert "Using the moving averages of the parameters" in caplog.text
