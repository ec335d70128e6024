"""A small, fully deterministic training job run as a subprocess by the reliability tests.

It trains an MLP with BatchNorm (mutable state), dropout (RNG) and Adam (optimizer state) on 8
simulated CPU devices, printing one ``LOOP <step>`` line per device loop and the estimator's
log lines (``Saving checkpoints for <step> ...``) to stdout, then ``DONE <step>``. Run it
again with the same arguments after killing it and it resumes.

Usage:
  python -m tests.estimator._train_job MODEL_DIR --max_steps 40 [--sleep 0.05] [--stateful]
  python -m tests.estimator._train_job MODEL_DIR --evaluate_until 40   # evaluate repeatedly
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ESTIMATOR_NO_PROGRESS_BAR", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import estimator  # noqa: E402
import hooks  # noqa: E402

BATCH = 32


def data(n: int = 256, d: int = 8, classes: int = 4):
    rng = np.random.RandomState(0)
    x = rng.randn(n, d).astype(np.float32)
    y = (x @ rng.randn(d, classes)).argmax(-1).astype(np.int32)
    return x, y


def model_fn(features, labels, mode, params):
    train = mode == estimator.ModeKeys.TRAIN
    h = nn.Dense(32, name="hidden")(features)
    h = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name="data")(h)
    h = nn.Dropout(0.3, deterministic=not train)(nn.relu(h))
    logits = nn.Dense(4, name="out")(h)
    mask = estimator.padding_mask()
    per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    loss = (per_row * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.adam(1e-2))


def input_fn(params):
    """Cycles through the data in a fixed shuffled order: deterministic, so resumable."""
    x, y = data()
    b = params["batch_size"]
    epoch = 0
    while True:
        order = np.random.RandomState(epoch).permutation(len(x))
        for i in range(0, len(x) - b + 1, b):
            yield x[order[i : i + b]], y[order[i : i + b]]
        epoch += 1


class Loader:
    """A pure-Python data loader with Grain-style ``get_state``/``set_state``."""

    def __init__(self, batch_size: int):
        self.x, self.y = data()
        self.batch_size = batch_size
        self.position = 0
        self.set_state_calls = 0

    def __iter__(self):
        return self

    def __next__(self):
        n = len(self.x) // self.batch_size
        epoch, i = divmod(self.position, n)
        order = np.random.RandomState(epoch).permutation(len(self.x))
        rows = order[i * self.batch_size : (i + 1) * self.batch_size]
        self.position += 1
        return self.x[rows], self.y[rows]

    def get_state(self) -> dict:
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        self.set_state_calls += 1
        print(f"SET_STATE {state['position']}", flush=True)
        self.position = state["position"]


class _Progress(hooks.SessionRunHook):
    """Prints each loop's last step; sleeps so a test can kill the job at a chosen loop."""

    def __init__(self, sleep: float):
        self.sleep = sleep

    def before_run(self, run_context):
        return hooks.SessionRunArgs("global_step")

    def after_run(self, run_context, run_values):
        print(f"LOOP {int(np.asarray(run_values.results)[-1])}", flush=True)
        time.sleep(self.sleep)


def make_estimator(model_dir: str, *, save_steps: int, keep: int | None, cache: str | None):
    config = estimator.RunConfig(
        model_dir=model_dir,
        tpu_config=estimator.TPUConfig(iterations_per_loop=2),
        save_checkpoints_steps=save_steps,
        keep_checkpoint_max=keep,
        tf_random_seed=1234,
        log_step_count_steps=0,
        save_summary_steps=0,
        compilation_cache_dir=cache,
    )
    return estimator.TPUEstimator(
        model_fn, config=config, train_batch_size=BATCH, eval_batch_size=BATCH
    )


def _eval_input_fn(params):
    x, y = data()
    for i in range(0, len(x), params["batch_size"]):
        yield x[i : i + params["batch_size"]], y[i : i + params["batch_size"]]


def evaluate_until(est, last_step: int, out: str) -> None:
    """Evaluates the latest checkpoint over and over while another process trains."""
    results, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        if est.latest_checkpoint() is None:
            time.sleep(0.05)
            continue
        r = est.evaluate(_eval_input_fn)
        results.append({"global_step": int(r["global_step"]), "loss": float(r["loss"])})
        print(f"EVAL {r['global_step']} {r['loss']!r}", flush=True)
        if r["global_step"] >= last_step:
            break
    with open(out, "w") as f:
        json.dump(results, f)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("--max_steps", type=int, default=40)
    p.add_argument("--save_steps", type=int, default=4)
    p.add_argument("--keep", type=int, default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--stateful", action="store_true", help="train from a get_state loader")
    p.add_argument("--cache", default=None, help="persistent compilation cache directory")
    p.add_argument("--evaluate_until", type=int, default=None)
    p.add_argument("--eval_out", default=None)
    args = p.parse_args(argv)
    logger = logging.getLogger("estimator")
    logger.handlers[:] = [logging.StreamHandler(sys.stdout)]
    logger.setLevel(logging.INFO)
    est = make_estimator(
        args.model_dir, save_steps=args.save_steps, keep=args.keep, cache=args.cache
    )
    if args.evaluate_until is not None:
        evaluate_until(est, args.evaluate_until, args.eval_out)
        return
    fn = (lambda params: Loader(params["batch_size"])) if args.stateful else input_fn
    est.train(fn, max_steps=args.max_steps, hooks=[_Progress(args.sleep)])
    print(f"DONE {est.get_variable_value('global_step')}", flush=True)


if __name__ == "__main__":
    main()
