"""One process of the two-process stall tests: the shrunk default job of ``_multihost_job``,
whose process 1 can block for ever in its training input_fn.

Launched by ``estimator.cluster.launch.start_local`` (TF_CONFIG says which process this is).
With ``--stall_at N`` process 1's input_fn blocks (``threading.Event().wait()``) before
yielding its batch ``N`` (counted from 0), printing ``STALL N``; its heartbeat thread goes
on, so only the progress watchdog can end the job. Without it the job trains to
``--max_steps`` and prints ``DONE``.

Usage:
  python -m tests.estimator._stall_job MODEL_DIR [--stall_at 12] [--max_steps 18]
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading

from estimator.cluster.cluster import TPUClusterResolver
from tests.estimator import _multihost_job as job


def stalling(input_fn, at: int):
    """``input_fn`` whose iterator blocks for ever before its batch ``at``."""

    def blocked(params, input_context=None):
        for i, batch in enumerate(input_fn(params, input_context)):
            if i == at:
                print(f"STALL {i}", flush=True)
                threading.Event().wait()  # a hung read: never set
            yield batch

    return blocked


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--stall_at", type=int, default=None)
    parser.add_argument("--max_steps", type=int, default=job.MAX_STEPS)
    args = parser.parse_args(argv)
    est, input_fns = job.build(
        args.model_dir, cluster=TPUClusterResolver(), max_steps=args.max_steps
    )
    import jax

    train = input_fns["train"]
    if args.stall_at is not None and jax.process_index() == 1:
        train = stalling(train, args.stall_at)
    est.train(train, max_steps=args.max_steps, hooks=[job._LoopPrinter(0.0, 0)])
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    logging.basicConfig(format="%(levelname)s:%(name)s:%(message)s")
    logging.getLogger("estimator").setLevel(logging.INFO)
    sys.exit(main())
