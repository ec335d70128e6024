"""Hooks driven by the real estimator: per-step cadence, lifecycle, NaN, early stopping."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import estimator
import hooks
from tests import helpers as h


def test_logging_hook_every_3_steps_with_loops_of_5(tmp_path, caplog):
    x, y = h.make_data()
    seen = []
    hook = hooks.LoggingTensorHook(
        {"step": "global_step", "loss": "loss"},
        every_n_iter=3,
        formatter=lambda d: seen.append(int(d["step"])) or "x",
    )
    with caplog.at_level(logging.INFO, logger="estimator"):
        h.make_estimator(tmp_path, ipl=5).train(h.train_input_fn(x, y), max_steps=14, hooks=[hook])
    assert seen == [3, 6, 9, 12]


class _Recorder(hooks.SessionRunHook):
    def __init__(self, stop_after_loops=None):
        self.calls, self.steps, self.loops = [], [], 0
        self.stop_after = stop_after_loops

    def begin(self):
        self.calls.append("begin")

    def after_create_session(self, session, coord):
        self.calls.append(f"after_create_session:{session.mode}")

    def before_run(self, run_context):
        self.calls.append("before_run")
        return hooks.SessionRunArgs({"loss": "loss"})

    def after_run(self, run_context, run_values):
        self.calls.append("after_run")
        self.loops += 1
        self.steps.append(run_context.steps.tolist())
        if run_values.results is not None:
            assert run_values.results["loss"].shape == (len(run_context.steps),)
        if self.stop_after and self.loops >= self.stop_after:
            run_context.request_stop()

    def end(self, session):
        self.calls.append("end")


def _lifecycle(mode, loops):
    return ["begin", f"after_create_session:{mode}"] + ["before_run", "after_run"] * loops + ["end"]


def test_lifecycle_and_request_stop_in_train(tmp_path):
    x, y = h.make_data()
    rec = _Recorder(stop_after_loops=2)
    est = h.make_estimator(tmp_path, ipl=3)
    est.train(h.train_input_fn(x, y), max_steps=30, hooks=[rec])
    assert rec.calls == _lifecycle("train", 2)
    assert rec.steps == [[1, 2, 3], [4, 5, 6]]
    assert est.get_variable_value("global_step") == 6


def test_lifecycle_and_request_stop_in_evaluate_and_predict(tmp_path):
    x, y = h.make_data(n=96)
    est = h.make_estimator(tmp_path, ipl=2)
    est.train(h.train_input_fn(x, y), max_steps=2)
    rec = _Recorder()
    est.evaluate(h.eval_input_fn(x, y), hooks=[rec])
    assert rec.calls == _lifecycle("eval", 3) and rec.steps == [[1, 2], [3, 4], [5, 6]]
    stop = _Recorder(stop_after_loops=1)
    est.evaluate(h.eval_input_fn(x, y), hooks=[stop])
    assert stop.calls == _lifecycle("eval", 1)

    class PredictRecorder(_Recorder):
        def before_run(self, run_context):
            super().before_run(run_context)
            return None

    rec = PredictRecorder(stop_after_loops=1)
    preds = list(est.predict(h.eval_input_fn(x), hooks=[rec]))
    assert rec.calls == _lifecycle("infer", 1)
    assert len(preds) == 32  # one loop of 2 batches of 16, then the hook stopped it


def test_spec_hooks_and_call_hooks_run_together(tmp_path):
    x, y = h.make_data()
    spec_rec = _Recorder()

    def model_fn(features, labels, mode, params):
        spec = h.model_fn(features, labels, mode, params)
        spec.training_hooks = (spec_rec,)
        return spec

    call_rec = _Recorder()
    h.make_estimator(tmp_path, model_fn, ipl=2).train(
        h.train_input_fn(x, y), max_steps=4, hooks=[call_rec]
    )
    assert spec_rec.calls == call_rec.calls == _lifecycle("train", 2)


def _nan_model_fn(bad_step):
    def model_fn(features, labels, mode, params):
        spec = h.model_fn(features, labels, mode, params)
        if mode == estimator.ModeKeys.TRAIN:
            step = estimator.get_global_step()  # the step being computed, 0-based
            spec.loss = jnp.where(step == bad_step - 1, jnp.nan, spec.loss)
        return spec

    return model_fn


def test_nan_loss_stops_at_the_step_and_no_bad_checkpoint(tmp_path):
    x, y = h.make_data()
    est = h.make_estimator(tmp_path, _nan_model_fn(7), ipl=2, save_checkpoints_steps=2)
    with pytest.raises(hooks.NanLossDuringTrainingError, match="step 7"):
        est.train(h.train_input_fn(x, y), max_steps=20)
    assert est.get_variable_value("global_step") == 6
    for name in est.get_variable_names():
        assert np.all(np.isfinite(est.get_variable_value(name))), name


def test_nan_check_can_be_turned_off_by_skipping(tmp_path):
    x, y = h.make_data()
    est = h.make_estimator(tmp_path, _nan_model_fn(3), ipl=2, skip_nonfinite_steps=True)
    est.train(h.train_input_fn(x, y), max_steps=6)
    for name in est.get_variable_names():
        assert np.all(np.isfinite(est.get_variable_value(name))), name


def test_stop_at_step_hook_lands_exactly(tmp_path):
    x, y = h.make_data()
    est = h.make_estimator(tmp_path, ipl=4)
    est.train(h.train_input_fn(x, y), hooks=[hooks.StopAtStepHook(num_steps=6)])
    assert est.get_variable_value("global_step") == 6
    est.train(h.train_input_fn(x, y), hooks=[hooks.StopAtStepHook(last_step=9)])
    assert est.get_variable_value("global_step") == 9


def test_checkpoint_saver_hook_with_listener(tmp_path):
    x, y = h.make_data()
    saved = []

    class Listener(hooks.CheckpointSaverListener):
        def after_save(self, session, global_step):
            saved.append(global_step)

    hook = hooks.CheckpointSaverHook(str(tmp_path), save_steps=4, listeners=[Listener()])
    h.make_estimator(tmp_path, ipl=2, keep_checkpoint_max=None).train(
        h.train_input_fn(x, y), max_steps=8, hooks=[hook]
    )
    assert saved[:2] == [4, 8]
    steps = sorted(int(p.name.split("-")[-1]) for p in tmp_path.glob("model.ckpt-*"))
    assert {4, 8} <= set(steps)


def _scripted_model_fn(scores):
    """Eval metric 'score' takes the next value of ``scores`` at each evaluation."""
    calls = {"n": 0}

    def metric_fn(labels):
        return {"score": float(scores[min(calls["n"] - 1, len(scores) - 1)])}

    def model_fn(features, labels, mode, params):
        spec = h.model_fn(features, labels, mode, params)
        if mode == estimator.ModeKeys.EVAL:
            spec.eval_metrics = (metric_fn, [labels])
        return spec

    class Counter(hooks.SessionRunHook):
        def after_create_session(self, session, coord):
            if session.mode == "eval":
                calls["n"] += 1

    return model_fn, Counter()


def test_early_stopping_in_train_and_evaluate(tmp_path):
    x, y = h.make_data()
    # score decreases until round 3, then stalls; with max_steps_without_decrease=4 and 2
    # steps per round the hook stops once the best is 4+ steps old: after round 5's eval.
    model_fn, counter = _scripted_model_fn([5.0, 4.0, 3.0, 3.5, 3.6, 3.7, 3.8, 3.9, 4.0, 4.1])
    est = h.make_estimator(tmp_path, model_fn, ipl=2, save_checkpoints_steps=2)
    stop = hooks.stop_if_no_decrease_hook(
        est, "score", max_steps_without_decrease=4, run_every_secs=0
    )
    result, _ = estimator.train_and_evaluate(
        est,
        estimator.TrainSpec(h.train_input_fn(x, y), max_steps=40, hooks=[stop]),
        estimator.EvalSpec(
            h.eval_input_fn(x[:32], y[:32]),
            steps=None,
            throttle_secs=0,
            start_delay_secs=0,
            hooks=[counter],
        ),
    )
    # evals at steps 2, 4, 6 (best 3.0), 8, 10. Training from 10 to 12 sees the eval at 10,
    # 4 steps after the best: the hook stops it, and the final evaluation is at step 12.
    assert stop.stopped_at_step == 12
    assert result["global_step"] == 12 and result["score"] == pytest.approx(3.7)


def test_train_and_evaluate_compiles_each_loop_once(tmp_path):
    x, y = h.make_data()
    est = h.make_estimator(tmp_path, ipl=2, save_checkpoints_steps=4)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: compiles.append(name) if "backend_compile" in name else None
    )
    spec_t = estimator.TrainSpec(h.train_input_fn(x, y), max_steps=4)
    spec_e = estimator.EvalSpec(
        h.eval_input_fn(x, y), steps=None, throttle_secs=0, start_delay_secs=0
    )
    estimator.train_and_evaluate(est, spec_t, spec_e)
    first_round = len(compiles)
    assert first_round > 0
    # Later rounds compile no train program again. The eval set's short tail ran padded to a
    # full call at first; once that padding has cost as much as a program of its own, the
    # tail's program is compiled, once (engine/tails.py, the ski-rental rule); then nothing.
    later = []
    for max_steps in (16, 28, 40):
        compiles.clear()
        result, _ = estimator.train_and_evaluate(
            est, estimator.TrainSpec(h.train_input_fn(x, y), max_steps=max_steps), spec_e
        )
        assert result["global_step"] == max_steps
        later.append(len(compiles))
    if later[-1]:  # the rule's moment depends on this machine's timings; it comes once
        compiles.clear()
        estimator.train_and_evaluate(
            est, estimator.TrainSpec(h.train_input_fn(x, y), max_steps=52), spec_e
        )
        later.append(len(compiles))
    assert sum(later) <= 1 and later[-1] == 0, later


class _Logs(logging.Handler):
    """Collects the estimator's log lines at INFO, whatever level earlier code set."""

    def __init__(self):
        super().__init__()
        self.lines = []
        self._logger = logging.getLogger("estimator")

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        self._level = self._logger.level
        self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


@pytest.mark.parametrize("use_tpu", [True, False])
def test_progress_lines_on_every_backend(tmp_path, use_tpu):
    x, y = h.make_data()
    with _Logs() as logs:
        est = estimator.TPUEstimator(
            h.model_fn,
            config=h.config(tmp_path, iterations_per_loop=2, log_step_count_steps=2),
            use_tpu=use_tpu,
            train_batch_size=16,
            eval_batch_size=16,
        )
        est.train(h.train_input_fn(x, y), max_steps=6)
        est.evaluate(h.eval_input_fn(x, y))
    text = "\n".join(logs.lines)
    assert "Training on" in text and "parameters" in text
    assert "loss = " in text and ", step = 6 (" in text
    assert "global_step/sec:" in text and "examples/sec:" in text
    assert "Saving dict for global step 6: accuracy = " in text


def test_logged_loss_is_the_replica_and_loop_mean(tmp_path):
    x, y = h.make_data()
    got = []

    class Loss(hooks.SessionRunHook):
        def before_run(self, run_context):
            return hooks.SessionRunArgs("loss")

        def after_run(self, run_context, run_values):
            got.append(run_values.results)

    with _Logs() as logs:
        h.make_estimator(tmp_path, ipl=4, log_step_count_steps=4).train(
            h.train_input_fn(x, y), max_steps=4, hooks=[Loss()]
        )
    line = next(m for m in logs.lines if m.startswith("loss = "))
    logged = line.split("=")[1].split(",")[0].strip()
    assert logged == f"{float(np.mean(got[0])):.4g}"  # 4 significant digits, not 16


def test_progress_bar_when_asked(tmp_path, capsys):
    x, y = h.make_data()
    h.make_estimator(tmp_path, ipl=2, progress_bar=True).train(h.train_input_fn(x, y), max_steps=4)
    err = capsys.readouterr().err
    assert "4/4" in err and "step" in err


def test_progress_bar_starts_after_the_compiling_loop_and_redirects_logging(monkeypatch):
    """The bar's rate and ETA leave out the first loop's compile time; log lines printed
    while it is shown go through tqdm instead of onto the bar's line."""
    import io
    import sys

    from tqdm.contrib.logging import _TqdmLoggingHandler

    from estimator.driver.progress import ProgressBarHook

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # where tqdm draws
    console = logging.StreamHandler(sys.stderr)
    monkeypatch.setattr(logging.root, "handlers", [console])
    bar = ProgressBarHook(start=10, total=20)
    bar.begin()
    assert bar._bar is None  # nothing is timed before the first loop ends
    seen = []
    for steps in ([11, 12], [13, 14], [15, 16]):
        context = hooks.SessionRunContext(None, None, steps=np.array(steps))
        bar.after_run(context, hooks.SessionRunValues(np.ones(2)))
        seen.append((bar._bar.n, bar._bar.initial, type(logging.root.handlers[-1])))
    bar.end(None)
    assert seen == [(n, 12, _TqdmLoggingHandler) for n in (12, 14, 16)]
    assert logging.root.handlers == [console]


def test_profiler_hook_writes_a_trace_for_tensorboard(tmp_path):
    x, y = h.make_data()
    est = h.make_estimator(tmp_path, ipl=2)
    est.train(h.train_input_fn(x, y), max_steps=6, hooks=[hooks.ProfilerHook(steps=[4])])
    traces = list((tmp_path / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1
