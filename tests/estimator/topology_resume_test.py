"""Resuming on another topology with the same global batch ends where the uninterrupted run
does: 8 devices -> 4 -> 1 in one process, and 1 process -> 2 -> 1 (docs/multihost.md,
"Resuming on another topology").

Each leg is the TF-style script (``tests/estimator/_tf_style_job.py``) started afresh on its
own devices and processes, training 4 more steps from the checkpoint the previous leg left;
the reference is the same job in this process on 8 devices without a stop. Its input is one
stream of examples cut into global batches, process ``i`` taking its rows of each, so every
topology sees the same global batches; the parameters after each leg must equal the
reference's at that step up to float reduction order.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from estimator.cluster import launch
from estimator.io.checkpoint_read import read_variables
from tests.estimator import _tf_style_job as job

LEG_STEPS = 4
TOLERANCE = 2e-7  # float32 sums in another order: measured 6e-8 after 12 Adam steps
TIMEOUTS = {"initialization_timeout": 60, "heartbeat_timeout": 8, "shutdown_timeout": 30}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``{step: variables}`` of the uninterrupted run (8 devices, this process)."""
    model_dir = str(tmp_path_factory.mktemp("reference"))
    est = job.build(model_dir)
    est.train(job.input_fn, max_steps=3 * LEG_STEPS)
    steps = range(LEG_STEPS, 3 * LEG_STEPS + 1, LEG_STEPS)
    return {s: read_variables(os.path.join(model_dir, f"model.ckpt-{s}")) for s in steps}


def _run_legs(root, legs: list[tuple[int, int]]) -> str:
    """Runs leg ``k`` (``(processes, devices per process)``) to step ``4 * (k + 1)``, each
    a fresh set of processes resuming from the model_dir the previous leg left."""
    model_dir, out_dir = str(root / "model"), str(root / "out")
    os.makedirs(out_dir)
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    for k, (processes, devices) in enumerate(legs):
        logs = root / f"leg_{k}"
        procs = launch.start_local(
            processes,
            [model_dir, out_dir, "--max_steps", str(LEG_STEPS * (k + 1))],
            command=[sys.executable, job.__file__],
            log_dir=str(logs),
            total_devices=processes * devices,
            timeouts=TIMEOUTS,
            base_env=env,
        )
        rc = launch.wait_all(procs, timeout=150, grace=20)
        text = "\n".join((logs / f"process_{i}.log").read_text()[-3000:] for i in range(processes))
        assert rc == 0, f"leg {k} ({processes} x {devices} devices) failed:\n{text}"
    return model_dir


def _assert_each_leg_matches(model_dir: str, reference: dict) -> None:
    for step, want in reference.items():
        got = read_variables(os.path.join(model_dir, f"model.ckpt-{step}"))
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            np.testing.assert_allclose(
                got[name], value, rtol=0, atol=TOLERANCE, err_msg=f"{name} at step {step}"
            )


def test_devices_8_then_4_then_1_with_the_same_global_batch(tmp_path, reference):
    model_dir = _run_legs(tmp_path, [(1, 8), (1, 4), (1, 1)])
    _assert_each_leg_matches(model_dir, reference)


def test_processes_1_then_2_then_1_with_the_same_global_batch(tmp_path, reference):
    model_dir = _run_legs(tmp_path, [(1, 8), (2, 4), (1, 8)])
    _assert_each_leg_matches(model_dir, reference)
