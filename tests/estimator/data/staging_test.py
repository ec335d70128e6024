"""Streaming input: a loop of iterations_per_loop steps as several bounded calls, no padded loops.

Each test compares against an independent run (a budget that fits the whole loop, IPL 1) or a
count the test derives itself (batches in the input, rows per step).
"""

import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
import hooks as hooks_lib
from estimator.driver import dispatch
from estimator.engine import tails
from tests import helpers as h

BATCH = 16  # 8 replicas x 2 rows
# One step's input per replica: 2 rows x (x: 6 float32, row: int32, label: int32, mask: float32)
STEP_BYTES = 2 * (6 * 4 + 4 + 4 + 4)

_compiles: list[str] = []
_listening = []


def _count_compiles() -> list[str]:
    if not _listening:
        jax.monitoring.register_event_duration_secs_listener(
            lambda name, *a, **k: _compiles.append(name) if "backend_compile" in name else None
        )
        _listening.append(True)
    _compiles.clear()
    return _compiles


def test_config_validates_the_budget():
    assert estimator.TPUConfig().max_staged_input_bytes is None  # the platform's default
    with pytest.raises(ValueError, match="max_staged_input_bytes"):
        estimator.TPUConfig(max_staged_input_bytes=0)
    with pytest.raises(TypeError, match="max_staged_input_bytes"):
        estimator.TPUConfig(max_staged_input_bytes=1.5e6)


# ----------------------------------------------------------------------------- training
def _input_fn(params):
    """Batch k holds rows k*B .. k*B+B-1 of a fixed dataset, so host rows are known exactly."""
    x, y = h.make_data(n=4 * BATCH)
    b = params["batch_size"]
    k = 0
    while True:
        i = (k % 4) * b
        yield (
            {"x": x[i : i + b], "row": np.arange(k * b, (k + 1) * b, dtype=np.int32)},
            y[i : i + b],
        )
        k += 1


def _model_fn(rows_seen: list):
    def host_fn(row, gs):
        rows_seen.append((int(gs[0]), row.copy()))

    def model_fn(features, labels, mode, params):
        logits = nn.Dense(3, name="out")(nn.relu(nn.Dense(8, name="hidden")(features["x"])))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        gs = jnp.reshape(estimator.get_global_step(), (1,))
        return estimator.TPUEstimatorSpec(
            mode,
            loss=loss,
            train_op=optax.adam(0.05),
            host_call=(host_fn, [features["row"], gs]),
        )

    return model_fn


class _Recorder(hooks_lib.SessionRunHook):
    """Records each loop's steps and the per-step losses the hook fetches."""

    def __init__(self):
        self.loops = []

    def before_run(self, run_context):
        return hooks_lib.SessionRunArgs({"loss": "loss", "step": "global_step"})

    def after_run(self, run_context, run_values):
        r = run_values.results
        self.loops.append((np.asarray(r["step"]).tolist(), np.asarray(r["loss"]).copy()))


def _train(model_dir, *, ipl, budget=None, stops=(10,)):
    rows, hook = [], _Recorder()
    tpu = {} if budget is None else {"max_staged_input_bytes": budget}
    cfg = h.config(model_dir, iterations_per_loop=ipl, tpu=tpu)
    est = estimator.TPUEstimator(_model_fn(rows), config=cfg, train_batch_size=BATCH)
    for stop in stops:
        est.train(_input_fn, max_steps=stop, hooks=[hook])
    return est, rows, hook


def _spy_calls(monkeypatch) -> list:
    """The step count of every compiled call, grouped by loop (one list per dispatch)."""
    loops = []
    original = dispatch.dispatch

    def spy(calls, *, launch, fetch, **options):
        loops.append([])

        def counted(chunk):
            loops[-1].append(chunk.steps)
            return launch(chunk)

        return original(calls, launch=counted, fetch=fetch, **options)

    monkeypatch.setattr(dispatch, "dispatch", spy)
    return loops


def test_ipl_1_and_1000_give_identical_params(tmp_path):
    one, _, _ = _train(tmp_path / "ipl1", ipl=1, stops=(12,))
    many, _, _ = _train(tmp_path / "ipl1000", ipl=1000, stops=(12,))
    a, b = h.params_of(one), h.params_of(many)
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_several_calls_per_loop_equal_one_call_per_loop(tmp_path, monkeypatch):
    """IPL 7 in calls of at most 3 steps (budget of 3 steps) against one call per loop; two
    train calls, the second resuming from the first's checkpoint and input position."""
    whole, whole_rows, whole_hook = _train(tmp_path / "whole", ipl=7, stops=(10, 17))
    calls = _spy_calls(monkeypatch)
    split, split_rows, split_hook = _train(
        tmp_path / "split", ipl=7, budget=3 * STEP_BYTES, stops=(10, 17)
    )
    # Loops of 7 ran as 3 + 3 + 1; the last loop of each train call ran its 3 or 7 steps.
    assert calls == [[3, 3, 1], [3], [3, 3, 1]]
    h.assert_params_close(h.params_of(whole), h.params_of(split), rtol=1e-6, atol=1e-7)
    # host_call: the same rows for the same steps, once each, in order.
    assert [s for s, _ in split_rows] == list(range(17))
    assert [s for s, _ in whole_rows] == list(range(17))
    for (_, a), (_, b) in zip(whole_rows, split_rows, strict=True):
        np.testing.assert_array_equal(a, b)
    # Hooks: one after_run per loop of IPL steps, the same steps and losses.
    assert [s for s, _ in split_hook.loops] == [s for s, _ in whole_hook.loops]
    assert [s for s, _ in split_hook.loops] == [
        list(range(1, 8)),
        [8, 9, 10],
        list(range(11, 18)),
    ]
    for (_, a), (_, b) in zip(whole_hook.loops, split_hook.loops, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert (
        estimator.TPUEstimator(
            _model_fn([]), config=h.config(tmp_path / "split"), train_batch_size=BATCH
        )
        .latest_checkpoint()
        .endswith("17")
    )


# ----------------------------------------------------------------------------- eval / predict
def _eval_model_fn(mask_sums: list):
    """The helpers' MLP, recording the real rows of every step each replica runs."""

    def model_fn(features, labels, mode, params):
        jax.debug.callback(lambda s: mask_sums.append(int(s)), estimator.padding_mask().sum())
        return h.model_fn(features, labels, mode, params)

    return model_fn


def _eval_estimator(model_dir, mask_sums, *, ipl, **tpu):
    x, y = h.make_data(n=BATCH * 4)
    est = h.make_estimator(model_dir, _eval_model_fn(mask_sums), batch=BATCH, ipl=ipl, tpu=tpu)
    est.train(h.train_input_fn(x, y), max_steps=1)
    return est


def test_evaluations_of_any_tail_compile_a_bounded_set_of_programs(tmp_path, monkeypatch):
    """IPL 8: inputs of 13, 11, 15 and 2 batches have tails 5 (4+1), 3 (2+1), 7 (4+2+1) and
    2; every evaluation counts each example once and no step runs on padding only. (The
    split tails, as ``engine/tails.py`` chooses them where padding costs more: forced here.)"""
    monkeypatch.setattr(tails.CallCosts, "pad", lambda self, real, planned, loop: False)
    mask_sums = []
    est = _eval_estimator(tmp_path, mask_sums, ipl=8)
    compiles = _count_compiles()
    lengths_compiled = []
    for batches in (13, 11, 15, 2, 13):
        n = batches * BATCH - 3  # a short last batch
        x, y = h.make_data(n=n, seed=batches)
        mask_sums.clear()
        before = len(compiles)
        results = est.evaluate(h.eval_input_fn(x, y))
        lengths_compiled.append(len(compiles) - before)
        # Each replica ran each of the `batches` steps once, and every example counted once.
        assert len(mask_sums) == batches * 8
        assert sum(mask_sums) == n
        reference = est.predict(h.eval_input_fn(x), yield_single_examples=False)
        logits = np.concatenate([p["logits"] for p in reference])
        assert logits.shape[0] == n
        np.testing.assert_allclose(results["accuracy"], np.mean(logits.argmax(-1) == y), 1e-6)
    # Programs of 8, 4 and 1 steps come with the first evaluation (with the restore's); the
    # second adds the 2-step one; tails 7, 2 and 5 need no new program.
    assert lengths_compiled[1:] == [1, 0, 0, 0]


def test_short_predict_at_a_long_loop_runs_only_its_steps_in_order(tmp_path):
    mask_sums = []
    est = _eval_estimator(tmp_path, mask_sums, ipl=200)
    x, _ = h.make_data(n=37)  # 3 batches: 16, 16, 5 rows
    mask_sums.clear()
    preds = list(est.predict(h.eval_input_fn(x, with_row=True)))
    assert [int(p["row"]) for p in preds] == list(range(37))
    assert len(mask_sums) == 3 * 8 and sum(mask_sums) == 37


def test_repeated_evaluate_starts_no_new_threads(tmp_path):
    est = _eval_estimator(tmp_path, [], ipl=4)
    x, y = h.make_data(n=5 * BATCH)
    est.evaluate(h.eval_input_fn(x, y))
    before = threading.active_count()
    for _ in range(4):
        est.evaluate(h.eval_input_fn(x, y))
        list(est.predict(h.eval_input_fn(x)))
    assert threading.active_count() <= before


class _EvalRecorder(hooks_lib.SessionRunHook):
    """Records each evaluation loop's step counters and per-step losses; asks to stop after
    ``stop_after`` loops."""

    def __init__(self, stop_after: int | None = None):
        self.loops, self.stop_after = [], stop_after

    def before_run(self, run_context):
        return hooks_lib.SessionRunArgs({"loss": "loss"})

    def after_run(self, run_context, run_values):
        loss = np.asarray(run_values.results["loss"]).copy()
        self.loops.append((np.asarray(run_context.steps).tolist(), loss))
        if self.stop_after is not None and len(self.loops) >= self.stop_after:
            run_context.request_stop()


def test_eval_hooks_see_each_loop_in_order_with_the_next_loop_queued(tmp_path, monkeypatch):
    """Calls run back to back across loops, yet hooks see every loop, including the partial
    last one, with exactly its steps and per-step losses (one step per loop's row here)."""
    est = _eval_estimator(tmp_path, [], ipl=2)
    loops = _spy_calls(monkeypatch)
    x, y = h.make_data(n=5 * BATCH - 3, seed=3)  # 5 batches: loops of 2, 2 and 1 steps
    hook = _EvalRecorder()
    results = est.evaluate(h.eval_input_fn(x, y), hooks=[hook])
    # One dispatch over every call of the evaluation: here one call, the merged 8-loop one
    # with its last 11 steps padding (engine/tails.py: cheaper than 2- and 1-step programs).
    assert loops == [[5]]
    assert [steps for steps, _ in hook.loops] == [[1, 2], [3, 4], [5]]
    per_step = np.concatenate([loss for _, loss in hook.loops])
    singles = [
        est.evaluate(h.eval_input_fn(x[i : i + BATCH], y[i : i + BATCH]))["loss"]
        for i in range(0, len(x), BATCH)
    ]
    # The full batches' losses as one evaluation per batch (a hook sees the replicas' mean,
    # which for the padded last batch is not the mean over its real rows).
    np.testing.assert_allclose(per_step[:4], singles[:4], rtol=1e-6)
    np.testing.assert_allclose(results["loss"], np.average(singles, weights=[16] * 4 + [13]))


def test_a_stop_after_a_loop_counts_only_the_loops_the_hooks_saw(tmp_path):
    """The next loop's first call is already queued when after_run asks to stop: its
    outputs are dropped, so the results are those of the loops run (as ``steps`` gives)."""
    est = _eval_estimator(tmp_path, [], ipl=2)
    x, y = h.make_data(n=6 * BATCH, seed=4)
    hook = _EvalRecorder(stop_after=1)
    stopped = est.evaluate(h.eval_input_fn(x, y), hooks=[hook])
    assert [steps for steps, _ in hook.loops] == [[1, 2]]
    reference = est.evaluate(h.eval_input_fn(x, y), steps=2)
    assert stopped["loss"] == reference["loss"]
    assert stopped["accuracy"] == reference["accuracy"]


# ----------------------------------------------------------------------------- merged loops
def _calls_and_loops(est, monkeypatch, x, y, **kw):
    """evaluate()'s results, its calls' step counts and the loops (steps, losses) hooks saw."""
    calls, hook = _spy_calls(monkeypatch), _EvalRecorder(kw.pop("stop_after", None))
    results = est.evaluate(h.eval_input_fn(x, y), hooks=[hook], **kw)
    return results, calls[-1], hook.loops


@pytest.mark.parametrize(
    "batches, steps, stop_after, merged_calls",
    [
        (40, None, None, [16, 16, 2, 2, 2, 2]),  # 20 loops of 2: two calls of 8 loops
        (37, None, None, [16, 16, 5]),  # the input ends inside the third call: padded
        (40, 35, None, [16, 16, 2, 1]),  # steps= ends inside a loop
        (40, None, 3, [16, 16]),  # a hook stops after 3 loops: the second call is dropped
    ],
)
def test_evaluation_runs_several_loops_per_call_as_it_runs_one(
    tmp_path, monkeypatch, batches, steps, stop_after, merged_calls
):
    """IPL 2 with a budget that fits 8 loops per call, against one loop per call: the same
    results, and hooks see the same loops with the same steps and per-step losses."""
    est = _eval_estimator(tmp_path, [], ipl=2)
    x, y = h.make_data(n=batches * BATCH - 5, seed=5)  # a short last batch
    kw = {"steps": steps, "stop_after": stop_after}
    merged = _calls_and_loops(est, monkeypatch, x, y, **kw)
    one_loop = estimator.TPUEstimator(  # the same checkpoint, one loop per call
        _eval_model_fn([]),
        config=h.config(
            tmp_path, iterations_per_loop=2, tpu={"max_staged_input_bytes": 2 * STEP_BYTES}
        ),
        train_batch_size=BATCH,
        eval_batch_size=BATCH,
    )
    reference = _calls_and_loops(one_loop, monkeypatch, x, y, **kw)
    if merged_calls is not None:
        assert merged[1] == merged_calls
    assert max(reference[1]) == 2
    assert merged[0] == reference[0]
    assert [s for s, _ in merged[2]] == [s for s, _ in reference[2]]
    for (_, a), (_, b) in zip(merged[2], reference[2], strict=True):
        np.testing.assert_array_equal(a, b)
    if stop_after is not None:
        assert [s for s, _ in merged[2]] == [[1, 2], [3, 4], [5, 6]]
        assert merged[0] == est.evaluate(h.eval_input_fn(x, y), steps=6)


def test_unrolled_evaluation_and_prediction_run_one_loop_per_call(tmp_path, monkeypatch):
    """An unrolled program grows with its steps, so evaluation merges only rolled loops;
    prediction never merges (IPL is how many batches a caller waits for)."""
    est = _eval_estimator(tmp_path / "unrolled", [], ipl=2, unroll_loops=True)
    x, y = h.make_data(n=20 * BATCH, seed=6)
    _, calls, loops = _calls_and_loops(est, monkeypatch, x, y)
    assert calls == [2] * 10 and len(loops) == 10
    rolled = _eval_estimator(tmp_path / "rolled", [], ipl=2)
    calls = _spy_calls(monkeypatch)
    assert len(list(rolled.predict(h.eval_input_fn(x)))) == len(x)
    assert calls[-1] == [2] * 10
