"""A fresh process that trains and evaluates a small MLP once, counting XLA compilations.

Run by compilation_test.py: ``python -m tests.estimator._startup_job MODEL_DIR [tae]``
(``tae``: through ``train_and_evaluate``, whose eval program compiles while training runs). It
uses the default ``RunConfig`` compilation cache (so the environment decides where it is) and
prints one JSON line: ``{"compiled", "events", "cache_hits", "names", "lowered", "results"}``
(``lowered``: how many programs JAX lowered to MLIR).
"""

from __future__ import annotations

import faulthandler
import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import estimator
from estimator.core.compilation import CompileCounter
from tests import helpers as h


def model_fn(features, labels, mode, params):
    """A two-layer MLP trained with Adam, so the optimizer state has slots and a count."""
    h1 = nn.relu(nn.Dense(16, name="hidden")(features["x"]))
    logits = nn.Dense(3, name="out")(h1)
    mask = estimator.padding_mask()
    per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    loss = (per_row * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    train = mode == estimator.ModeKeys.TRAIN
    return estimator.TPUEstimatorSpec(
        mode,
        loss=loss,
        train_op=optax.adam(1e-2) if train else None,
        eval_metrics=(h.metric_fn, [labels, logits]),
    )


LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def main(model_dir: str, how: str = "") -> None:
    x, y = h.make_data(n=64)
    lowered = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: lowered.append(seconds) if event == LOWERING else None
    )
    with CompileCounter() as counter:
        est = estimator.TPUEstimator(
            model_fn,
            config=estimator.RunConfig(
                model_dir=model_dir,
                tpu_config=estimator.TPUConfig(iterations_per_loop=4),
                log_step_count_steps=0,
                save_summary_steps=0,
            ),
            train_batch_size=16,
            eval_batch_size=16,
        )
        if how == "tae":
            results, _ = estimator.train_and_evaluate(
                est,
                estimator.TrainSpec(h.train_input_fn(x, y), max_steps=12),
                estimator.EvalSpec(h.eval_input_fn(x, y), throttle_secs=10**6),
            )
        else:
            est.train(h.train_input_fn(x, y), max_steps=12)
            results = est.evaluate(h.eval_input_fn(x, y))
    out = {
        "compiled": counter.compiled,
        "events": counter.events,
        "cache_hits": counter.cache_hits,
        "names": counter.names,
        "lowered": len(lowered),
        "results": {k: float(v) for k, v in results.items()},
    }
    print("STARTUP_JOB " + json.dumps(out), flush=True)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows its threads' stacks
    main(*sys.argv[1:])
