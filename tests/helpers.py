"""Small models and data shared by the tests."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import estimator
import metrics


def make_data(n: int = 96, d: int = 6, classes: int = 3, seed: int = 0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, d).astype(np.float32)
    w = rng.randn(d, classes).astype(np.float32)
    y = (x @ w).argmax(-1).astype(np.int32)
    return x, y


def metric_fn(labels, logits):
    return {"accuracy": metrics.accuracy(labels, logits.argmax(-1))}


def model_fn(features, labels, mode, params):
    """A two-layer MLP with BatchNorm (so state is averaged over replicas) and eval metrics."""
    train = mode == estimator.ModeKeys.TRAIN
    x = features["x"] if isinstance(features, dict) else features
    h = nn.Dense(params.get("hidden", 16), name="hidden")(x)
    if params.get("batch_norm", False):
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name="data")(h)
    logits = nn.Dense(params.get("classes", 3), name="out")(nn.relu(h))
    if mode == estimator.ModeKeys.PREDICT:
        return estimator.TPUEstimatorSpec(
            mode,
            predictions={"logits": logits, "row": features.get("row", logits)}
            if isinstance(features, dict)
            else {"logits": logits},
        )
    mask = estimator.padding_mask()
    per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    loss = (per_row * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    return estimator.TPUEstimatorSpec(
        mode,
        loss=loss,
        train_op=optax.sgd(params.get("lr", 0.1)) if train else None,
        eval_metrics=(metric_fn, [labels, logits]),
    )


def train_input_fn(x, y, *, features_dict: bool = True):
    """Cycles through (x, y) in order, batch by batch (deterministic, so resumable)."""

    def input_fn(params):
        b = params["batch_size"]
        while True:
            for i in range(0, len(x) - b + 1, b):
                f = {"x": x[i : i + b]} if features_dict else x[i : i + b]
                yield f, y[i : i + b]

    return input_fn


def eval_input_fn(x, y=None, *, with_row: bool = False):
    def input_fn(params):
        b = params["batch_size"]
        for i in range(0, len(x), b):
            f = {"x": x[i : i + b]}
            if with_row:
                f["row"] = np.arange(i, min(i + b, len(x)), dtype=np.int32)
            yield (f, y[i : i + b]) if y is not None else f

    return input_fn


def config(model_dir, **kw) -> estimator.RunConfig:
    ipl = kw.pop("iterations_per_loop", 4)
    tpu = estimator.TPUConfig(iterations_per_loop=ipl, **kw.pop("tpu", {}))
    kw.setdefault("log_step_count_steps", 0)
    kw.setdefault("save_summary_steps", 0)
    return estimator.RunConfig(model_dir=str(model_dir), tpu_config=tpu, **kw)


def make_estimator(
    model_dir,
    model_fn=model_fn,
    *,
    batch: int = 16,
    ipl: int = 4,
    params: dict | None = None,
    use_tpu: bool = True,
    warm_start_from=None,
    **cfg,
) -> estimator.TPUEstimator:
    """The tests' estimator (the suite's one factory): ``batch`` rows in every mode, ``ipl``
    steps per loop, quiet logging; ``cfg`` goes to ``RunConfig`` (``tpu={...}`` to
    ``TPUConfig``)."""
    return estimator.TPUEstimator(
        model_fn,
        config=config(model_dir, iterations_per_loop=ipl, **cfg),
        params=params or {},
        use_tpu=use_tpu,
        warm_start_from=warm_start_from,
        train_batch_size=batch,
        eval_batch_size=batch,
        predict_batch_size=batch,
    )


def params_of(est) -> dict:
    names = est.get_variable_names()
    return {n: est.get_variable_value(n) for n in names}


def assert_params_close(a: dict, b: dict, **tol):
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), err_msg=k, **tol)


__all__ = [
    "jax",
    "make_data",
    "model_fn",
    "train_input_fn",
    "eval_input_fn",
    "config",
    "make_estimator",
]
