"""The default job end to end through the installed console script, in a fresh process."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from estimator.cli import app as cli


def _console_script() -> list[str]:
    exe = shutil.which("tpu-estimator", path=os.path.dirname(sys.executable)) or shutil.which(
        "tpu-estimator"
    )
    return [exe] if exe else [sys.executable, "-m", "estimator"]


def test_default_job_from_console_script(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    cmd = _console_script() + [
        "--model_dir",
        str(tmp_path),
        "--config.max_steps=200",
        "--config.iterations_per_loop=50",
        "--config.save_checkpoints_steps=100",
        "--config.log_step_count_steps=50",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["global_step"] == 200
    assert results["accuracy"] >= 0.9
    assert "loss = " in out.stderr and ", step = 50 (" in out.stderr
    assert "global_step/sec" in out.stderr
    assert "Saving dict for global step 200" in out.stderr
    assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == "200"


def test_subcommands_share_the_model_dir(tmp_path):
    args = ["--config", "configs/digits_mlp_small.py", "--model_dir", str(tmp_path)]
    cli.main(["train", *args])
    results = cli.run(*cli.parse_args(["evaluate", *args]))
    assert results["global_step"] == 40
    preds = cli.run(*cli.parse_args(["predict", *args]))
    assert preds["num_predictions"] == 359


@pytest.mark.parametrize(
    "override,error",
    [
        ("--config.no_such_field=1", KeyError),
        ("--config.max_steps='many'", TypeError),
    ],
)
def test_bad_overrides_name_the_key(tmp_path, override, error):
    with pytest.raises(error, match="max_steps|no_such_field"):
        cli.run(*cli.parse_args(["train", "--model_dir", str(tmp_path), override]))
