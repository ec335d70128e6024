"""A train_and_evaluate job with exporters, run as a subprocess by the stop-and-restart tests.

It trains the shared MLP for 16 steps, saving and evaluating every 4, with a ``BestExporter``
and three slow recording exporters (each prints ``EXPORT <name> <step>`` when it starts and
appends its step to ``<model_dir>/exports.log`` when it is done); each evaluation loop prints
``EVAL LOOP`` and waits ``--eval_sleep`` seconds, so a test can signal it mid-evaluation.

Usage:
  python -m tests.estimator._tae_job MODEL_DIR [--export_sleep 0.5] [--eval_sleep 0]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ESTIMATOR_NO_PROGRESS_BAR", "1")

import sys  # noqa: E402

# The portable export only: a TF SavedModel per export would take seconds each.
sys.modules["tensorflow"] = None  # type: ignore[assignment]

import argparse  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import estimator  # noqa: E402
import hooks  # noqa: E402
from tests import helpers  # noqa: E402

X, Y = helpers.make_data(n=96)


class Recording(estimator.Exporter):
    """An exporter that takes ``sleep`` seconds and records the step it exported."""

    def __init__(self, name: str, sleep: float):
        self._name, self.sleep = name, sleep

    @property
    def name(self) -> str:
        return self._name

    def export(self, estimator, export_path, checkpoint_path, eval_result, is_the_final_export):
        step = eval_result["global_step"]
        print(f"EXPORT {self._name} {step}", flush=True)
        time.sleep(self.sleep)
        with open(os.path.join(estimator.model_dir, "exports.log"), "a") as f:
            f.write(f"{self._name} {step}\n")
        return export_path


class EvalLoops(hooks.SessionRunHook):
    def __init__(self, sleep: float):
        self.sleep = sleep

    def after_run(self, run_context, run_values):
        print("EVAL LOOP", flush=True)
        time.sleep(self.sleep)


def serving_input_fn():
    return estimator.build_raw_serving_input_receiver_fn(
        {"x": np.zeros((1, X.shape[1]), np.float32)}
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("--export_sleep", type=float, default=0.5)
    p.add_argument("--eval_sleep", type=float, default=0.0)
    args = p.parse_args(argv)
    logger = logging.getLogger("estimator")
    logger.handlers[:] = [logging.StreamHandler(sys.stdout)]
    logger.setLevel(logging.INFO)
    est = helpers.make_estimator(
        args.model_dir, save_checkpoints_steps=4, params={"lr": 0.5}, tf_random_seed=7
    )
    exporters = [
        estimator.BestExporter("best", serving_input_fn(), exports_to_keep=None),
        *(Recording(name, args.export_sleep) for name in ("a", "b", "c")),
    ]
    result, _ = estimator.train_and_evaluate(
        est,
        estimator.TrainSpec(helpers.train_input_fn(X, Y), max_steps=16),
        estimator.EvalSpec(
            helpers.eval_input_fn(X, Y),
            steps=None,
            throttle_secs=0,
            exporters=exporters,
            hooks=[EvalLoops(args.eval_sleep)],
        ),
    )
    print(f"DONE {result['global_step']}", flush=True)


if __name__ == "__main__":
    main()
