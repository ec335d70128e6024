"""The default job's model, shrunk, run by the many-process tests (one process of a job each).

Launched by ``estimator.launch.start_local``: TF_CONFIG says which process this is, and
``RunConfig(cluster=TPUClusterResolver())`` joins the job. It trains (printing ``LOOP <step>``
after every device loop), then evaluates and predicts, and writes what it saw to
``<out_dir>/process_<i>.json``. ``build`` is also imported by the tests to run the same job in
one process.

With ``--probe`` it only joins the job and checks the cross-process helpers, printing one
``PROBE <json>`` line.

Usage:
  python -m tests.estimator._multihost_job MODEL_DIR OUT_DIR [--max_steps 18] [--sleep 0]
      [--sleep_from 0] [--train_only] [--shard_params]
  python -m tests.estimator._multihost_job --probe
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np

import estimator
import hooks
import models
from estimator.cli import jobs
from estimator.cluster.cluster import TPUClusterResolver

MAX_STEPS = 18
SAVE_EVERY = 9
# 360 eval examples in batches of 112: the last global batch has 24 rows, all from process 0,
# so process 1's eval input ends one batch (and with 3 steps per loop, one loop) earlier.
EVAL_BATCH = 112


def job_config(max_steps: int = MAX_STEPS):
    """The default job (configs/digits_mlp.py), shrunk to a few loops."""
    config = jobs.load_config()
    config.model_params.hidden = (64,)
    config.max_steps = max_steps
    config.iterations_per_loop = 3
    config.save_checkpoints_steps = SAVE_EVERY
    config.eval_batch_size = EVAL_BATCH
    config.predict_batch_size = EVAL_BATCH
    config.host_call_every_n_steps = 1
    config.save_summary_steps = 3
    config.log_step_count_steps = 0
    return config


def build(model_dir: str, *, cluster=None, max_steps: int = MAX_STEPS, shard_params=False):
    """The estimator and input_fns of the shrunk default job (``shard_params``: parameters and
    optimizer state split over the replicas)."""
    config = job_config(max_steps)
    run_config = jobs.run_config(config, model_dir).replace(cluster=cluster)
    if shard_params:
        tpu = run_config.tpu_config.replace(shard_params=True)
        run_config = run_config.replace(tpu_config=tpu)
    est = estimator.TPUEstimator(
        models.MODELS[config.model],
        config=run_config,
        params=config.model_params.to_dict(),
        use_tpu=True,
        train_batch_size=config.train_batch_size,
        eval_batch_size=config.eval_batch_size,
        predict_batch_size=config.predict_batch_size,
    )
    return est, models.DATASETS[config.dataset](config)


class _LoopPrinter(hooks.SessionRunHook):
    """Prints each loop's last step; from step ``sleep_from`` on, sleeps ``sleep`` seconds
    after each loop so a test can act mid-training."""

    def __init__(self, sleep: float, sleep_from: int):
        self.sleep, self.sleep_from = sleep, sleep_from

    def before_run(self, run_context):
        return hooks.SessionRunArgs("global_step")

    def after_run(self, run_context, run_values):
        step = int(np.asarray(run_values.results)[-1])
        print(f"LOOP {step}", flush=True)
        if step >= self.sleep_from:
            time.sleep(self.sleep)


def probe() -> dict:
    """Joins the job through TPUStrategy(cluster_resolver) and exercises the helpers that
    communicate between processes."""
    strategy = estimator.TPUStrategy(TPUClusterResolver())
    import jax

    from estimator.parallel import multihost

    me = jax.process_index()
    out = {
        "process_index": me,
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "devices": jax.device_count(),
        "replicas_in_sync": strategy.num_replicas_in_sync,
        "gathered": multihost.gather_objects({"index": me, "pid": os.getpid()}),
        "broadcast": multihost.broadcast_object(f"from {me}"),
        "any_of": list(multihost.any_of(me == 1, False)),
    }
    try:
        multihost.run_on_process_0(lambda: 1 / 0, "probe")
    except Exception as e:  # noqa: BLE001 - reported
        out["remote_error"] = type(e).__name__
    out["after_error"] = multihost.run_on_process_0(lambda: {"value": 7}, "probe")
    try:  # a host function that failed on process 0 only stops every process
        multihost.check_worker(_FailingWorker(me == 0), "host_call")
        out["worker_error"] = None
    except Exception as e:  # noqa: BLE001 - reported
        out["worker_error"] = type(e).__name__
    return out


class _FailingWorker:
    """Stands in for a HostWorker whose task raised (on this process, if ``fail``)."""

    def __init__(self, fail: bool):
        self.failed = fail

    def check(self) -> None:
        if self.failed:
            raise ZeroDivisionError("host_call raised")

    join = check


def main(argv=None) -> int:
    if "--probe" in (sys.argv[1:] if argv is None else argv):
        print("PROBE " + json.dumps(probe()), flush=True)
        return 0
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--max_steps", type=int, default=MAX_STEPS)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--sleep_from", type=int, default=0)
    parser.add_argument("--train_only", action="store_true")
    parser.add_argument("--shard_params", action="store_true")
    args = parser.parse_args(argv)
    resolver = TPUClusterResolver()  # reads TF_CONFIG
    est, input_fns = build(
        args.model_dir, cluster=resolver, max_steps=args.max_steps, shard_params=args.shard_params
    )
    import jax

    latest = est.latest_checkpoint()
    out = {
        "pid": os.getpid(),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "devices": jax.device_count(),
        "replicas": est.num_replicas,
        "start_step": 0 if latest is None else int(latest.split("-")[-1]),
    }
    est.train(
        input_fns["train"],
        max_steps=args.max_steps,
        hooks=[_LoopPrinter(args.sleep, args.sleep_from)],
    )
    out["final_step"] = int(est.latest_checkpoint().split("-")[-1])
    if args.shard_params:  # what one device holds: (params, optimizer state) bytes
        state = est._job.store.last.state
        out["bytes_per_device"] = [
            sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards[:1])
            for tree in (state.params, state.opt_state)
        ]
    if not args.train_only:
        results = est.evaluate(input_fns["eval"])
        out["eval"] = {k: float(v) for k, v in results.items()}
        out["predict_local"] = [int(p["class_ids"]) for p in est.predict(input_fns["predict"])]
        out["predict_gathered"] = [
            int(p["class_ids"]) for p in est.predict(input_fns["predict"], gather_to_process_0=True)
        ]
    path = os.path.join(args.out_dir, f"process_{jax.process_index()}.json")
    with open(path, "w") as f:
        json.dump(out, f)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    # A script is the application: it shows the library's INFO lines (the library itself
    # configures no logging).
    logging.basicConfig(format="%(levelname)s:%(name)s:%(message)s")
    logging.getLogger("estimator").setLevel(logging.INFO)
    sys.exit(main())
