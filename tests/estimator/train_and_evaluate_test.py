"""train_and_evaluate at TF's cadence: one training stream, evaluations on throttled checkpoints
and at the end, one event file per writer.

The references are counts taken outside the estimator (input_fn calls, files on disk) and
TensorBoard's own event reader.
"""

import importlib
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
