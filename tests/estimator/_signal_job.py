"""A training job that a test stops with real signals (SIGTERM, SIGINT), run as a subprocess.

It runs the named phases one after another in one process (one start-up for all), each on
its own ``WORKDIR/<phase>`` model_dir, printing markers the test reacts to:

- ``stall``: the input yields 6 batches, prints ``STALLED`` and never yields again; the test
  sends SIGTERM; prints ``PREEMPTED stall <step>``.
- ``slow_host``: a host_call that sleeps 50 ms per step and prints ``HOST <n>``; the test sends
  SIGTERM after a while; prints ``PREEMPTED slow_host ...``.
- ``abort``: the progress hook sleeps 3 s after step 6; the test sends SIGINT twice; prints
  ``ABORTED <message>``.
- ``interrupt``: the test sends SIGINT once; the KeyboardInterrupt is not caught, so the
  process ends as a user's script would (the test reads its stderr).

Every phase prints ``LOOP <step>`` after each device loop and ``PHASE <name>`` first.

Usage:
  python -m tests.estimator._signal_job WORKDIR --phases stall,slow_host,abort,interrupt
"""

from __future__ import annotations

# Importing the fault-injection job first sets its environment (8 CPU devices) before JAX is
# imported; the batch size and data are shared with it.
from tests.estimator._train_job import BATCH, data

# isort: split
import argparse
import logging
import os
import sys
import threading
import time

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

import estimator
import hooks
from tests import helpers as h


def make_model_fn(host_sleep: float | None):
    calls = [0]

    def host_fn(loss):
        time.sleep(host_sleep)
        calls[0] += 1
        print(f"HOST {calls[0]}", flush=True)

    def model_fn(features, labels, mode, params):
        logits = nn.Dense(4, name="out")(nn.relu(nn.Dense(32, name="hidden")(features)))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        host_call = None if host_sleep is None else (host_fn, [jnp.reshape(loss, (1,))])
        return estimator.TPUEstimatorSpec(
            mode, loss=loss, train_op=optax.adam(1e-2), host_call=host_call
        )

    return model_fn


def stalling(params):
    """Six batches, then a wait that never ends (a dead data server)."""
    x, y = data()
    b = params["batch_size"]
    for i in range(6):
        yield x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]
    print("STALLED", flush=True)
    threading.Event().wait()


class _Progress(hooks.SessionRunHook):
    def __init__(self, sleep_after: dict[int, float]):
        self.sleep_after = sleep_after

    def before_run(self, run_context):
        return hooks.SessionRunArgs("global_step")

    def after_run(self, run_context, run_values):
        step = int(np.asarray(run_values.results)[-1])
        print(f"LOOP {step}", flush=True)
        time.sleep(self.sleep_after.get(step, 0.01))


def make_estimator(model_dir: str, *, host_sleep: float | None, cache: str | None):
    config = estimator.RunConfig(
        model_dir=model_dir,
        tpu_config=estimator.TPUConfig(iterations_per_loop=2),
        save_checkpoints_steps=1000,
        tf_random_seed=1234,
        log_step_count_steps=0,
        save_summary_steps=0,
        compilation_cache_dir=cache,
    )
    return estimator.TPUEstimator(make_model_fn(host_sleep), config=config, train_batch_size=BATCH)


def run_phase(name: str, workdir: str, cache: str | None) -> None:
    print(f"PHASE {name}", flush=True)
    model_dir = os.path.join(workdir, name)
    est = make_estimator(model_dir, host_sleep=0.05 if name == "slow_host" else None, cache=cache)
    input_fn = stalling if name == "stall" else h.train_input_fn(*data(), features_dict=False)
    progress = _Progress({6: 3.0} if name == "abort" else {})
    if name == "interrupt":  # uncaught: the process ends as a user's script would
        est.train(input_fn, max_steps=100_000, hooks=[progress])
        return
    try:
        est.train(input_fn, max_steps=100_000, hooks=[progress])
    except estimator.Preempted as e:
        print(f"PREEMPTED {name} {e.global_step}", flush=True)
    except KeyboardInterrupt as e:
        print(f"ABORTED {e}", flush=True)
    else:
        print(f"RETURNED {name}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("--phases", default="stall,slow_host,abort,interrupt")
    p.add_argument("--cache", default=None)
    args = p.parse_args(argv)
    logger = logging.getLogger("estimator")
    logger.handlers[:] = [logging.StreamHandler(sys.stdout)]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for name in args.phases.split(","):
        run_phase(name, args.workdir, args.cache)


if __name__ == "__main__":
    main()
