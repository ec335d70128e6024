"""A TF-style training script: ``RunConfig(model_dir=...)`` and nothing about processes.

Run as it is (one process) or under the local launcher, which sets ``TF_CONFIG``; the
``RunConfig`` joins that job by itself (nothing here names a cluster). It trains a small MLP
with Adam to ``--max_steps``; ``--evaluate`` then evaluates with a new estimator (every
process). With ``--readers i``, process ``i`` alone reads the checkpoint back
(``get_variable_value``, ``get_variable_names``, ``latest_checkpoint``, ``list_variables``,
``load_variable``, ``checkpoints_iterator``) while the other processes go on to exit; with
``--readers 0,1`` the processes read one after another (each alone: the next waits for the
previous one's output file, not a collective). Each process writes what it saw to
``<out_dir>/process_<i>.json`` and prints ``DONE``.

The input is one stream of examples cut into global batches; process ``i`` of ``n`` takes
rows ``[i*b, (i+1)*b)`` of every global batch (``input_context``), so any number of processes
and devices trains on the same global batches (the topology tests resume it elsewhere).

Usage:
  python tests/estimator/_tf_style_job.py MODEL_DIR OUT_DIR [--max_steps 6] [--evaluate]
      [--readers 0,1]
  python -m estimator.cluster.launch --num_processes 2 -- tests/estimator/_tf_style_job.py ...
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

import estimator

GLOBAL_BATCH = 32
SAVE_EVERY = 4


def data(n: int = 512, d: int = 8, classes: int = 4):
    rng = np.random.RandomState(0)
    x = rng.randn(n, d).astype(np.float32)
    y = (x @ rng.randn(d, classes)).argmax(-1).astype(np.int32)
    return x, y


def model_fn(features, labels, mode, params):
    h = nn.relu(nn.Dense(16, name="hidden")(features))
    logits = nn.Dense(4, name="out")(h)
    mask = estimator.padding_mask()
    per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    loss = (per_row * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.adam(1e-2))


def input_fn(params, input_context=None):
    """This process's rows of each global batch of one example stream (cycled)."""
    x, y = data()
    n, i = 1, 0
    if input_context is not None:
        n, i = input_context.num_input_pipelines, input_context.input_pipeline_id
    b = params["batch_size"]
    rows = b * n
    start = 0
    while True:
        idx = (np.arange(start, start + rows) % len(x))[i * b : (i + 1) * b]
        yield x[idx], y[idx]
        start += rows


def build(model_dir: str, **config) -> estimator.TPUEstimator:
    run_config = estimator.RunConfig(
        model_dir=model_dir,
        save_checkpoints_steps=SAVE_EVERY,
        keep_checkpoint_max=None,
        log_step_count_steps=0,
        tpu_config=estimator.TPUConfig(iterations_per_loop=2),
        **config,
    )
    return estimator.TPUEstimator(
        model_fn, config=run_config, train_batch_size=GLOBAL_BATCH, eval_batch_size=GLOBAL_BATCH
    )


def eval_input_fn(params, input_context=None):
    """Three global batches of the stream, this process's rows of each."""
    batches = input_fn(params, input_context)
    for _ in range(3):
        yield next(batches)


def read_alone(est: estimator.TPUEstimator) -> dict:
    """Every checkpoint read, by this process alone."""
    names = est.get_variable_names()
    latest = est.latest_checkpoint()
    return {
        "names": names,
        "values": {n: np.asarray(est.get_variable_value(n)).tolist() for n in names},
        "latest": latest,
        "module_latest": estimator.latest_checkpoint(est.model_dir),
        "list_variables": estimator.list_variables(est.model_dir),
        "load_variable": np.asarray(estimator.load_variable(latest, "out/bias")).tolist(),
        "iterated": next(iter(estimator.checkpoints_iterator(est.model_dir, timeout=0)), None),
    }


def _wait_for(path: str, limit: float = 120.0) -> None:
    """Until ``path`` exists (another process's output): each reader reads alone."""
    stop = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > stop:
            raise TimeoutError(f"{path} did not appear within {limit} s")
        time.sleep(0.05)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--evaluate", action="store_true", help="then evaluate, all processes")
    parser.add_argument("--readers", default="", help="processes reading alone, in order")
    args = parser.parse_args(argv)
    est = build(args.model_dir)
    import jax

    me = jax.process_index()
    out = {"pid": os.getpid(), "process_index": me, "process_count": jax.process_count()}
    out["devices"] = [jax.local_device_count(), jax.device_count()]
    est.train(input_fn, max_steps=args.max_steps)
    out["final_step"] = int(est.latest_checkpoint().rsplit("-", 1)[-1])
    if args.evaluate:  # a new estimator: it restores the checkpoint (every process together)
        results = build(args.model_dir).evaluate(eval_input_fn)
        out["eval"] = {k: float(v) for k, v in results.items()}
    readers = [int(r) for r in args.readers.split(",") if r]
    path = os.path.join(args.out_dir, f"process_{me}.json")
    if me in readers:
        before = readers[: readers.index(me)]
        for other in before:  # the previous reader has finished (and may have exited)
            _wait_for(os.path.join(args.out_dir, f"process_{other}.json"))
        start = time.monotonic()
        out["read"] = read_alone(est)
        out["read_secs"] = time.monotonic() - start
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    logging.basicConfig(format="%(levelname)s:%(name)s:%(message)s")
    logging.getLogger("estimator").setLevel(logging.INFO)
    sys.exit(main())
