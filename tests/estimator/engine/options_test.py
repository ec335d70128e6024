"""The train step's options (``engine/options.py``): one table from config and mesh to
``StepOptions``, the donation rule, the precision ``Policy``'s two casts, and that the options
are resolved once and read from one place."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import estimator
from estimator.core.spec import ModeKeys
from estimator.engine.options import StepOptions, loop_unrolled
from estimator.engine.precision import Policy
from estimator.parallel.mesh import make_mesh
from tests import helpers as h
from tests.estimator.driver.jobs import make_job

DEFAULTS = {
    "policy": Policy(),
    "num_microbatches": 1,
    "skip_nonfinite": False,
    "sharded_state": False,
    "sharded_params": False,
    "unroll": False,
}


REPLICATED = {"sharded_state": False, "sharded_params": False}
ZERO = {"sharded_state": True, "sharded_params": False}
FSDP = {"sharded_state": True, "sharded_params": True}


@pytest.mark.parametrize(
    "run, tpu, mesh, expected",
    [
        # (RunConfig fields, TPUConfig fields, (replicas, cores per replica), options set)
        ({}, {}, (8, 1), {}),  # the defaults: float32, one micro-batch, replicated state
        ({}, {"compute_dtype": "bfloat16"}, (8, 1), {"policy": Policy("bfloat16")}),
        # float16 scales the loss, and loss scaling skips (and counts) overflowing steps
        (
            {},
            {"compute_dtype": "float16"},
            (8, 1),
            {"policy": Policy("float16"), "skip_nonfinite": True},
        ),
        ({"skip_nonfinite_steps": True}, {}, (8, 1), {"skip_nonfinite": True}),
        ({}, {"num_microbatches": 4}, (8, 1), {"num_microbatches": 4}),
        ({}, {"shard_optimizer_state": True}, (8, 1), ZERO),
        ({}, {"shard_params": True}, (8, 1), FSDP),  # the parameters split: the state too
        ({}, {"shard_params": True, "shard_optimizer_state": True}, (4, 2), FSDP),
        ({}, {"shard_optimizer_state": True}, (1, 1), REPLICATED),  # nothing to split over
        ({}, {"shard_params": True}, (1, 8), REPLICATED),  # one replica of 8 cores
        ({}, {"unroll_loops": True}, (8, 1), {"unroll": True}),
        ({}, {"unroll_loops": None, "iterations_per_loop": 10}, (8, 1), {"unroll": True}),
        ({}, {"unroll_loops": None, "iterations_per_loop": 11}, (8, 1), {}),  # too long
    ],
)
def test_options_of_config_and_mesh(tmp_path, run, tpu, mesh, expected):
    """The table runs on CPU, where ``unroll_loops=None`` unrolls short training loops."""
    tpu = dict(tpu)
    ipl = tpu.pop("iterations_per_loop", 4)
    config = h.config(tmp_path, iterations_per_loop=ipl, tpu=tpu, **run)
    replicas, cores = mesh
    mesh = make_mesh(num_replicas=replicas, num_cores_per_replica=cores)
    assert jax.default_backend() == "cpu"
    assert StepOptions.of(config, mesh) == StepOptions(**{**DEFAULTS, **expected})


@pytest.mark.parametrize(
    "skip_nonfinite, per_step_flags, keeps",
    [
        (False, False, True),  # the per-call program keeps its input for a replay
        (False, True, False),  # the per-step program finds the step itself: donated
        (True, False, False),  # a finite input gives a finite result: nothing to replay
        (True, True, False),
    ],
)
def test_a_train_program_keeps_its_input_only_for_a_replay(skip_nonfinite, per_step_flags, keeps):
    options = StepOptions(skip_nonfinite=skip_nonfinite)
    assert options.keeps_input(per_step_flags) is keeps


@pytest.mark.parametrize(
    "unroll_loops, backend, mode, ipl, unrolled",
    [
        (None, "cpu", ModeKeys.TRAIN, 10, True),
        (None, "tpu", ModeKeys.TRAIN, 10, False),
        (None, "cpu", ModeKeys.EVAL, 1, False),
        (True, "tpu", ModeKeys.PREDICT, 100, True),
        (False, "cpu", ModeKeys.TRAIN, 1, False),
    ],
)
def test_loop_unrolled(monkeypatch, unroll_loops, backend, mode, ipl, unrolled):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    tpu = estimator.TPUConfig(unroll_loops=unroll_loops, iterations_per_loop=ipl)
    assert loop_unrolled(tpu, mode) is unrolled


def test_the_options_are_resolved_once_and_read_through_the_job(tmp_path):
    job = make_job(tmp_path, skip_nonfinite_steps=True, tpu={"compute_dtype": "bfloat16"})
    assert job.options is job.programs.options is job.programs.options
    assert job.options == StepOptions.of(job.config, job.mesh)
    assert job.options.unroll is job.programs.unrolled(ModeKeys.TRAIN)
    assert job.programs.keeps_train_input() is False  # skipping: the input is donated


@pytest.mark.parametrize("name, dtype", [(None, jnp.float32), ("bfloat16", jnp.bfloat16)])
def test_policy_casts_in_and_out(name, dtype):
    policy = Policy(name)
    variables = {
        "params": {"w": jnp.ones(2, jnp.float32), "n": jnp.ones(2, jnp.int32)},
        "batch_stats": {"mean": jnp.zeros(2, jnp.float32)},
    }
    cast, x = policy.to_compute(variables, {"x": jnp.ones(3, jnp.float32)})
    assert cast["params"]["w"].dtype == dtype and x["x"].dtype == dtype
    assert cast["params"]["n"].dtype == jnp.int32  # ints are kept
    assert cast["batch_stats"]["mean"].dtype == jnp.float32  # read as stored
    computed = {"mean": jnp.ones(2, dtype)}
    host, new_state = policy.from_compute({"y": x["x"]}, computed, variables["batch_stats"])
    assert host["y"].dtype == jnp.float32 and new_state["mean"].dtype == jnp.float32
    assert policy.from_compute(None) == (None, None)
    np.testing.assert_array_equal(np.asarray(host["y"]), np.ones(3, np.float32))


def test_loss_scaling_is_float16s():
    assert [Policy(n).loss_scaled for n in (None, "bfloat16", "float16")] == [False, False, True]


# The config fields whose decisions StepOptions holds under its own names: only the config
# (which declares them) and engine/options.py (which resolves them) read them.
_RESOLVED = {"shard_optimizer_state", "shard_params", "skip_nonfinite_steps", "unroll_loops"}
_READERS = {"config.py", "engine/options.py"}


def test_only_the_options_read_what_they_resolve():
    root = pathlib.Path(estimator.__file__).parent
    readers = {
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in _RESOLVED
    }
    assert readers <= _READERS, f"read StepOptions instead: {sorted(readers - _READERS)}"
