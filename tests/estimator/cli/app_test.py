"""The ``tpu-estimator`` command as a user meets it: results, help, errors and manners."""

import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import models
from estimator.cli import app as cli

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
ENV = dict(os.environ)  # conftest set XLA_FLAGS (8 devices) before this module loaded
SMALL = ["--config", "digits_mlp_small"]
# Warnings a normal run must not print: the project's own Orbax use caused these.
PROJECT_WARNINGS = ("WARNING:absl", "Type handler registry", "read only", "save_interval_steps")


def _console_script() -> list[str]:
    exe = shutil.which("tpu-estimator", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "estimator"]


def _cli(*args, cwd=ROOT, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "estimator", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        cwd=cwd,
    )


def test_default_job_from_console_script(tmp_path):
    cmd = _console_script() + [
        "--model_dir",
        str(tmp_path),
        "--config.max_steps=200",
        "--config.iterations_per_loop=50",
        "--config.save_checkpoints_steps=100",
        "--config.log_step_count_steps=50",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = out.stdout.strip().splitlines()  # the result and nothing else on stdout
    results = json.loads(line)
    assert results["global_step"] == 200 and results["model_dir"] == str(tmp_path)
    assert results["accuracy"] >= 0.9
    assert "loss = " in out.stderr and ", step = 50 (" in out.stderr
    assert "global_step/sec" in out.stderr
    assert "Saving dict for global step 200" in out.stderr
    assert (tmp_path / "model.ckpt-200").is_dir()
    assert not [w for w in PROJECT_WARNINGS if w in out.stderr], out.stderr


def _eval_labels(config_name: str) -> np.ndarray:
    from estimator.cli import configs

    config = configs.load_config(config_name)
    batches = models.DATASETS[config.dataset](config)["eval"]({"batch_size": 64})
    return np.concatenate([labels for _, labels in batches])


def test_train_evaluate_predict_share_the_model_dir(tmp_path, capsys):
    args = [*SMALL, "--model_dir", str(tmp_path)]
    assert cli.main(["train", *args]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained == {"global_step": 40, "model_dir": str(tmp_path)}
    assert cli.main(["evaluate", *args]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["global_step"] == 40 and evaluated["model_dir"] == str(tmp_path)

    npz, jsonl = tmp_path / "p.npz", tmp_path / "p.jsonl"
    for path in (npz, jsonl):
        assert cli.main(["predict", *args, "--output", str(path)]) == 0
        done = json.loads(capsys.readouterr().out)
        assert done == {
            "global_step": 40,
            "model_dir": str(tmp_path),
            "num_predictions": 359,
            "output": str(path),
        }
    arrays = np.load(npz)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert arrays["logits"].shape == (359, 10) and len(rows) == 359
    np.testing.assert_array_equal(arrays["class_ids"], [r["class_ids"] for r in rows])
    np.testing.assert_allclose(arrays["logits"], [r["logits"] for r in rows], rtol=1e-6)
    np.testing.assert_array_equal(arrays["class_ids"], arrays["logits"].argmax(-1))
    buf = io.StringIO()  # --output -: the JSON lines are the output, no result line
    assert cli.main(["predict", *args, "--output", "-"], out=buf) == 0
    assert [json.loads(line) for line in buf.getvalue().splitlines()] == rows
    # The written predictions score what evaluate reported on the same examples.
    accuracy = np.mean(arrays["class_ids"] == _eval_labels("digits_mlp_small"))
    assert accuracy == pytest.approx(evaluated["accuracy"], abs=1e-6)


def test_help_imports_no_jax_and_describes_each_command():
    script = textwrap.dedent(
        """
        import io, sys, time
        start = time.perf_counter()
        from estimator.cli import app as cli
        texts = {}
        calls = ["--help"], ["train", "--help"], ["predict", "-h"], ["--config", "digits_cnn", "-h"]
        for args in calls:
            buf = io.StringIO()
            assert cli.main(args, out=buf) == 0
            texts[" ".join(args)] = buf.getvalue()
        import json
        jax = sorted(m for m in sys.modules if m == "jax" or m.startswith("jax."))
        print(json.dumps({"texts": texts, "seconds": time.perf_counter() - start, "jax": jax}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert found["jax"] == []
    texts = found["texts"]
    top, train, predict, fields = (texts[k] for k in texts)
    for name in ("train_and_evaluate", "evaluate", "predict", "export"):
        assert name in top
    for config in ("digits_mlp", "digits_cnn", "transformer_lm", "resnet18_cifar_synthetic"):
        assert config in top
    assert "Train to the config's max_steps" in train and "--output" not in train
    assert "--output FILE" in predict and ".npz" in predict
    assert "fields of digits_cnn" in fields and "model_params.features" in fields
    assert "model_params.hidden" not in fields  # digits_mlp's, not this config's


def test_help_in_a_fresh_process_is_quick():
    start = time.perf_counter()
    out = _cli("train", "--help", timeout=60)
    elapsed = time.perf_counter() - start
    assert out.returncode == 0 and out.stdout.startswith("usage: tpu-estimator train")
    assert elapsed < 5, elapsed  # ~0.3 s on an idle machine; JAX's import alone takes 3-5 s


@pytest.fixture(scope="module")
def a_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "a_file"
    path.write_text("not a directory")
    return str(path)


ERRORS = [
    (["--modeldir", "/tmp/x"], "unknown option --modeldir (did you mean --model_dir?)"),
    (["traain"], "unknown command 'traain' (did you mean train?)"),
    (["train", "--output", "p.npz"], "--output is an option of predict, not of train"),
    (["--config.max_step=5"], "did you mean --config.max_steps?"),
    (["--config.model_params.hiden=(64,)"], "did you mean --config.model_params.hidden?"),
    (["--config.model_params.hidden=(64"], "syntax error in the value: '(' was never closed"),
    (["--config.max_steps=many"], "expected int (like 600); 'many' is not a Python literal"),
    (["--config", "digits_mpl"], "no such file or packaged config (did you mean digits_mlp?)"),
    (["predict"], "predict reads a trained model: give --model_dir DIR"),
    (["train", "--model_dir", "A_FILE"], "is a file, not a directory"),
]


@pytest.mark.parametrize("args,message", ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_user_errors_are_one_line_and_status_2(args, message, a_file):
    args = [a_file if a == "A_FILE" else a for a in args]
    out = _cli(*args, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) <= 2 and message in lines[0], out.stderr


def test_verbose_adds_the_traceback():
    out = _cli("--config.max_step=5", "--verbose", timeout=60)
    assert out.returncode == 2 and "Traceback" in out.stderr and "UsageError" in out.stderr


def test_no_checkpoint_from_a_directory_with_its_own_models_package(tmp_path):
    """Also: ``python -m estimator`` in a project that has a ``models/`` package of its own."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    (tmp_path / "empty").mkdir()
    out = _cli("evaluate", *SMALL, "--model_dir", str(tmp_path / "empty"), cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and out.stdout == ""
    (error,) = out.stderr.strip().splitlines()  # found before JAX: no traceback to offer
    assert error.startswith("tpu-estimator: error: Could not find trained model in model_dir")
    assert not [w for w in PROJECT_WARNINGS if w in out.stderr], out.stderr


def test_user_logging_config_receives_the_estimators_lines(tmp_path):
    """An application that logs to a file gets our INFO lines there (no handler of ours)."""
    log_file = tmp_path / "app.log"
    script = textwrap.dedent(
        f"""
        import logging
        logging.basicConfig(filename={str(log_file)!r}, level=logging.INFO)
        import estimator
        from estimator.cli import configs, jobs
        config = configs.load_config("digits_mlp_small")
        configs.apply_overrides(config, {{"max_steps": "4", "log_step_count_steps": "2"}})
        est, input_fns = jobs.build(config, {str(tmp_path / "run")!r})
        est.train(input_fns["train"], max_steps=4)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    logged = log_file.read_text()
    assert "INFO:estimator:Training on 8 cpu device(s)" in logged
    assert "INFO:estimator:loss = " in logged and "Saving checkpoints for 4" in logged
    assert "INFO:estimator" not in out.stderr  # nothing of ours besides the user's handler


def test_stdout_holds_only_the_result():
    """Run as the program, the command keeps stdout for its result: what C++ code (Gloo's
    "Rank ... connected") or a library prints to file descriptor 1 goes to stderr."""
    script = textwrap.dedent(
        """
        import os, sys
        from estimator.cli import app
        out = app._take_stdout()
        os.write(1, b"[Gloo] Rank 0 is connected\\n")
        print("a library's print", flush=True)
        out.write('{"global_step": 1}\\n')
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == '{"global_step": 1}\n'
    assert "[Gloo] Rank 0 is connected" in out.stderr and "a library's print" in out.stderr


def test_trainer_features_from_the_command_line(tmp_path, capsys, caplog):
    from estimator.io.checkpoint_utils import list_variables, load_variable

    args = [
        *SMALL,
        "--model_dir",
        str(tmp_path),
        "--config.compute_dtype=bfloat16",
        "--config.num_microbatches=2",
        "--config.model_params.moving_average_decay=0.9",
    ]
    with caplog.at_level("INFO", logger="estimator"):
        assert cli.main(["train_and_evaluate", *args]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["global_step"] == 40 and result["accuracy"] > 0.5
    names = dict(list_variables(str(tmp_path)))
    shadows = [n for n in names if n.endswith("/ExponentialMovingAverage")]
    assert shadows and all(names[n] == names[n.rsplit("/", 1)[0]] for n in shadows)
    kernel = next(n for n in names if n.endswith("kernel"))
    assert load_variable(str(tmp_path), kernel).dtype == np.float32  # float32 masters
    assert "compute_dtype bfloat16 (float32 weights); num_microbatches 2 (8 rows each)" in (
        caplog.text
    )
    assert "Using the moving averages of the parameters" in caplog.text
