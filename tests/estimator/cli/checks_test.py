"""The command line's checks before JAX: user errors found without importing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

# Runs main() in a fresh process and reports, at the moment main returned, whether JAX (or
# the estimator's JAX side) had been imported: the error must come before either.
PROBE = textwrap.dedent(
    """
    import io, json, sys
    from estimator.cli import main
    err = io.StringIO()
    sys.stderr = err
    status = main(json.loads(sys.argv[1]), out=io.StringIO())
    sys.stderr = sys.__stderr__
    heavy = [m for m in ("jax", "flax", "orbax", "estimator.tpu_estimator") if m in sys.modules]
    print(json.dumps({"status": status, "stderr": err.getvalue(), "imported": heavy}))
    """
)


def _probe(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(args))],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def dirs(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("x")
    return tmp_path


CASES = [
    (["evaluate", "--model_dir", "EMPTY"], "Could not find trained model in model_dir"),
    (["predict", "--model_dir", "MISSING"], "Could not find trained model in model_dir"),
    (["export", "--model_dir", "EMPTY"], "Could not find trained model in model_dir"),
    (["train", "--config.iterations_per_loop=0"], "iterations_per_loop must be positive"),
    (["train", "--config.train_batch_size=-3"], "train_batch_size=-3: expected a positive"),
    (
        ["predict", "--model_dir", "EMPTY", "--output", "MISSING/p.jsonl"],
        "the directory",
    ),
    (["export", "--model_dir", "EMPTY", "--export_dir", "A_FILE"], "is a file"),
    (["train", "--config.compute_dtype=bf16"], "compute_dtype must be None, 'bfloat16'"),
    (["train", "--config.num_microbatches=0"], "num_microbatches must be positive"),
    # issue 42: each used to fail after JAX started, or with a raw error and status 1
    (["train", "--config.num_microbatches=3"], "num_microbatches=3 must divide the train batch"),
    (["train", "--config", "/etc/passwd"], "--config /etc/passwd: not a Python config file"),
    (["train", "--model_dir", "/proc/self/x"], "--model_dir /proc/self/x: cannot be made a"),
    (
        ["predict", "--model_dir", "EMPTY", "--output", "/proc/1/mem"],
        "--output /proc/1/mem: cannot be written (Permission denied)",
    ),
    (
        ["train", f"--config.seed={2**70}"],
        f"--config.seed={2**70}: tf_random_seed must fit in 64 bits",
    ),
]


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_user_errors_come_before_jax(args, message, dirs):
    names = {"EMPTY": dirs / "empty", "MISSING": dirs / "missing", "A_FILE": dirs / "a_file"}
    args = [str(names[a]) if a in names else a for a in args]
    args = [a.replace("MISSING", str(dirs / "missing")) for a in args]
    found = _probe(*args)
    assert found["status"] == 2, found
    assert found["imported"] == [], found  # the error came before JAX and the estimator
    lines = found["stderr"].strip().splitlines()
    assert len(lines) == 1 and message in lines[0], found["stderr"]


def test_a_model_dir_that_may_hold_a_checkpoint_goes_on(tmp_path):
    """Only a certainly empty model_dir is refused early; any step directory goes on to the
    estimator (which reads it, and here finds it unreadable)."""
    from estimator.cli import checks

    assert not checks.may_hold_checkpoint(str(tmp_path))
    assert not checks.may_hold_checkpoint(str(tmp_path / "missing"))
    (tmp_path / "model.ckpt-12.orbax-checkpoint-tmp-1").mkdir()  # unfinished: not a step
    assert not checks.may_hold_checkpoint(str(tmp_path))
    (tmp_path / "checkpoints" / "40").mkdir(parents=True)  # the legacy layout
    assert checks.may_hold_checkpoint(str(tmp_path))
    (tmp_path / "model.ckpt-7").mkdir()
    assert checks.may_hold_checkpoint(str(tmp_path))
    assert checks.may_hold_checkpoint("gs://bucket/run")


def test_checkpoint_layouts_agree_with_the_store(tmp_path):
    """The JAX-free test names the same step directories as ``io/step_names.py``."""
    from estimator.cli import checks
    from estimator.io import step_names

    for name in ("model.ckpt-0", "model.ckpt-12", "model.ckpt-012", "model.ckpt-x", "other"):
        d = tmp_path / name
        d.mkdir()
        assert checks.may_hold_checkpoint(str(tmp_path)) == step_names.has_checkpoints(
            str(tmp_path)
        ), name
        d.rmdir()


def test_compute_dtype_can_be_set_back_to_float32(tmp_path):
    """Issue 42: ``--config.compute_dtype`` took no value meaning "none" (float32)."""
    from estimator.cli import checks, configs

    for value in ("none", "None", "float32", ""):
        config = configs.load_config("digits_mlp")
        configs.apply_overrides(config, {"compute_dtype": "bfloat16"})
        configs.apply_overrides(config, {"compute_dtype": value})
        assert "compute_dtype" not in checks.given_fields(config, checks.TPU_CONFIG_FIELDS)
        checks.check_job("train", config, model_dir=str(tmp_path / "run"))


def test_a_config_mistake_leaves_no_model_dir_made(tmp_path):
    from estimator.cli.app import main

    status = main(["train", "--model_dir", str(tmp_path / "run"), "--config.num_microbatches=3"])
    assert status == 2
    assert not (tmp_path / "run").exists()


def test_the_output_check_changes_nothing(tmp_path):
    from estimator.cli import checks
    from estimator.cli.usage import UsageError

    existing = tmp_path / "p.jsonl"
    existing.write_text("kept\n")
    checks.check_output(str(existing))
    assert existing.read_text() == "kept\n"  # opened without truncating
    checks.check_output(str(tmp_path / "new.jsonl"))
    assert not (tmp_path / "new.jsonl").exists()  # created and removed again
    with pytest.raises(UsageError, match="is a directory"):
        checks.check_output(str(tmp_path))
