"""train_and_evaluate at TF's cadence: one training stream, evaluations on throttled checkpoints
and at the end, one event file per writer.

The references are counts taken outside the estimator (input_fn calls, files on disk) and
TensorBoard's own event reader.
"""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import estimator
import hooks
from hooks.event_reader import read_eval_metrics
from tests import helpers as h

tae = importlib.import_module("estimator.train_and_evaluate")  # the module, not the function


class _Counted:
    """An input_fn that counts how often the estimator calls it."""

    def __init__(self, input_fn):
        self.input_fn, self.calls = input_fn, 0

    def __call__(self, params):
        self.calls += 1
        return self.input_fn(params)


def _event_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("events.out.tfevents.*"))


def _checkpoint_steps(model_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[-1]) for p in model_dir.glob("model.ckpt-*[0-9]"))


def test_default_config_trains_in_one_stream_and_evaluates_at_the_end(tmp_path):
    x, y = h.make_data()
    train_fn, eval_fn = _Counted(h.train_input_fn(x, y)), _Counted(h.eval_input_fn(x, y))
    est = estimator.TPUEstimator(
        h.model_fn,
        config=estimator.RunConfig(model_dir=str(tmp_path)),  # TF's defaults: IPL 2, 600 s
        use_tpu=False,  # one device: 1,000 loops of 2 steps in a few seconds
        train_batch_size=16,
        eval_batch_size=16,
    )
    result, exports = estimator.train_and_evaluate(
        est,
        estimator.TrainSpec(train_fn, max_steps=2000),
        estimator.EvalSpec(eval_fn, steps=None),
    )
    assert result["global_step"] == 2000 and exports == []
    assert train_fn.calls == 1  # one training input stream, never restarted
    assert eval_fn.calls == 1  # 2,000 steps take far less than 600 s: the final eval only
    assert _checkpoint_steps(tmp_path) == [2000]
    assert len(_event_files(tmp_path)) == 1
    assert len(_event_files(tmp_path / "eval")) == 1
    assert list(read_eval_metrics(str(tmp_path / "eval"))) == [2000]


class _FakeTime(hooks.SessionRunHook):
    """Training time as a function of the global step: one second per step."""

    def __init__(self):
        self.now = 0.0

    def before_run(self, run_context):
        return hooks.SessionRunArgs("global_step")

    def after_run(self, run_context, run_values):
        self.now = float(run_values.results[-1])


def test_checkpoints_trigger_evaluations_at_most_every_throttle_secs(tmp_path, monkeypatch):
    x, y = h.make_data()
    clock = _FakeTime()
    monkeypatch.setattr(tae, "_now", lambda: clock.now)
    train_fn, eval_fn = _Counted(h.train_input_fn(x, y)), _Counted(h.eval_input_fn(x, y))
    est = estimator.TPUEstimator(
        h.model_fn,
        config=h.config(tmp_path, iterations_per_loop=2, save_checkpoints_steps=4),
        train_batch_size=16,
        eval_batch_size=16,
    )
    result, _ = estimator.train_and_evaluate(
        est,
        estimator.TrainSpec(train_fn, max_steps=42, hooks=[clock]),
        estimator.EvalSpec(eval_fn, steps=None, throttle_secs=10, name="held_out"),
    )
    # Checkpoints every 4 steps (4 s). The first is evaluated; then the first checkpoint at
    # least 10 s later (16, 28, 40); the final one (42) once at the end.
    evaluated = sorted(read_eval_metrics(str(tmp_path / "eval_held_out")))
    assert evaluated == [4, 16, 28, 40, 42]
    assert result["global_step"] == 42 and eval_fn.calls == len(evaluated)
    assert train_fn.calls == 1
    assert len(_event_files(tmp_path / "eval_held_out")) == 1
    assert len(_event_files(tmp_path)) == 1


def test_a_saving_listener_sees_every_checkpoint_and_can_stop_training(tmp_path):
    x, y = h.make_data()
    calls = []

    class Listener(hooks.CheckpointSaverListener):
        def begin(self):
            calls.append("begin")

        def before_save(self, session, step):
            calls.append(("before", step))

        def after_save(self, session, step):
            calls.append(("after", step))
            return step >= 8  # stop once step 8 is saved

        def end(self, session, step):
            calls.append(("end", step))

    est = estimator.TPUEstimator(
        h.model_fn,
        config=h.config(tmp_path, iterations_per_loop=2, save_checkpoints_steps=4),
        train_batch_size=16,
    )
    est.train(h.train_input_fn(x, y), max_steps=20, saving_listeners=[Listener()])
    assert calls == [
        "begin",
        ("before", 4),
        ("after", 4),
        ("before", 8),
        ("after", 8),
        ("end", 8),
    ]
    assert _checkpoint_steps(tmp_path) == [4, 8]
    with pytest.raises(TypeError, match="saving_listeners"):
        est.train(h.train_input_fn(x, y), max_steps=24, saving_listeners=Listener())


# ------------------------------------------------------------- stopped and restarted
def _tae_job(model_dir, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.estimator._tae_job", str(model_dir), *args],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _run_until(job, stop_on: str, sig) -> list[str]:
    """Reads the job's output and sends ``sig`` at the first line starting with ``stop_on``."""
    seen = []
    for line in job.stdout:
        seen.append(line.rstrip("\n"))
        if line.startswith(stop_on):
            job.send_signal(sig)
            break
    seen += [line.rstrip("\n") for line in job.stdout]
    job.wait(timeout=120)
    return seen


def _best_export_steps(model_dir: Path) -> list[int]:
    import json

    base = model_dir / "export" / "best"
    signatures = base.glob("*/assets.extra/signature.json")
    return sorted(json.loads(p.read_text())["global_step"] for p in signatures)


def _recorded(model_dir: Path) -> list[str]:
    path = model_dir / "exports.log"
    return path.read_text().splitlines() if path.exists() else []


def test_an_evaluation_killed_before_its_exports_is_exported_on_restart(tmp_path):
    """Issue: SIGKILL right after the evaluation's events, before the exports: the restarted
    job restored that step, never evaluated it again, and BestExporter lost it."""
    import signal

    seen = _run_until(_tae_job(tmp_path), "Saving dict for global step 8", signal.SIGKILL)
    assert any(s.startswith("Saving dict for global step 8") for s in seen), seen[-10:]
    assert "a 8" not in _recorded(tmp_path)  # killed before its exports
    out = _run_until(_tae_job(tmp_path), "never", signal.SIGKILL)
    assert out[-1] == "DONE 16", out[-10:]
    assert any("Evaluating and exporting step 8 again" in s for s in out), out
    assert {"a 8", "b 8", "c 8"} <= set(_recorded(tmp_path))
    evals = read_eval_metrics(str(tmp_path / "eval"))
    best, best_loss = [], float("inf")  # the best-so-far sequence, from TensorBoard's events
    for step, result in sorted(evals.items()):
        if result["loss"] < best_loss:
            best, best_loss = best + [step], result["loss"]
    assert 8 in best and _best_export_steps(tmp_path) == best


def test_sigterm_between_exporters_stops_at_once_and_the_restart_finishes_them(tmp_path):
    """Issue: SIGTERM during train_and_evaluate's exports waited for every exporter."""
    import signal

    seen = _run_until(_tae_job(tmp_path, "--export_sleep", "2"), "EXPORT a 4", signal.SIGTERM)
    assert not any(s.startswith("EXPORT b") for s in seen), seen  # stopped before exporter b
    assert any("left to the restarted job" in s for s in seen), seen
    assert _recorded(tmp_path) == ["a 4"]
    out = _run_until(_tae_job(tmp_path), "never", signal.SIGKILL)
    assert out[-1] == "DONE 16", out[-10:]
    recorded = _recorded(tmp_path)
    for name in "abc":
        assert f"{name} 4" in recorded, recorded


def test_sigterm_during_an_evaluation_stops_it_and_the_restart_evaluates_it(tmp_path):
    import signal

    job = _tae_job(tmp_path, "--eval_sleep", "1")
    seen = _run_until(job, "EVAL LOOP", signal.SIGTERM)
    assert job.returncode == 143, seen[-10:]
    assert not any(s.startswith("Saving dict for global step") for s in seen), seen
    assert not any(s.startswith("EXPORT") for s in seen), seen
    out = _run_until(_tae_job(tmp_path), "never", signal.SIGKILL)
    assert out[-1] == "DONE 16", out[-10:]
    assert sorted(read_eval_metrics(str(tmp_path / "eval"))) == [4, 8, 12, 16]
