"""TensorBoard summaries, read back with TensorBoard's own event reader."""

import flax.linen as nn
import numpy as np
import optax
import pytest
from tensorboard.backend.event_processing import event_accumulator as ea

import estimator
import hooks
from estimator import summary
from tests import helpers as h

BATCH, STEPS, EVERY = 16, 15, 5


def _input_fn(params):
    x, y = h.make_data(n=BATCH)
    b = params["batch_size"]
    k = 0
    while True:
        yield {"x": x[:b], "row": np.arange(k * b, (k + 1) * b, dtype=np.int32)}, y[:b]
        k += 1


def _host_fn(row):
    summary.scalar("row_sum", row.sum())
    summary.histogram("rows", row)
    summary.image("rows_image", (row.reshape(4, 4, 1) % 256).astype(np.uint8))
    summary.text("first_row", f"first row {row[0]}")


def _model_fn(features, labels, mode, params):
    logits = nn.Dense(3, name="out")(features["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    if mode == estimator.ModeKeys.TRAIN:
        return estimator.TPUEstimatorSpec(
            mode, loss=loss, train_op=optax.sgd(0.1), host_call=(_host_fn, [features["row"]])
        )
    return estimator.TPUEstimatorSpec(mode, loss=loss, eval_metrics=(h.metric_fn, [labels, logits]))


class _LossRecorder(hooks.SessionRunHook):
    def __init__(self):
        self.losses = {}

    def before_run(self, run_context):
        return hooks.SessionRunArgs({"loss": "loss", "step": "global_step"})

    def after_run(self, run_context, run_values):
        r = run_values.results
        self.losses.update(zip(r["step"].tolist(), r["loss"].tolist(), strict=True))


def _reader(path):
    acc = ea.EventAccumulator(
        str(path), size_guidance={"scalars": 0, "tensors": 0, "images": 0, "histograms": 0}
    )
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("summaries")
    cfg = h.config(model_dir, iterations_per_loop=EVERY, save_summary_steps=EVERY)
    est = estimator.TPUEstimator(
        _model_fn, config=cfg, train_batch_size=BATCH, eval_batch_size=BATCH
    )
    recorder = _LossRecorder()
    est.train(_input_fn, max_steps=STEPS, hooks=[recorder])
    x, y = h.make_data(n=40)
    results = est.evaluate(h.eval_input_fn(x, y))
    named = est.evaluate(h.eval_input_fn(x[:24], y[:24]), name="holdout")
    return model_dir, recorder.losses, results, named


def test_host_call_summaries_read_back_with_their_steps(run):
    model_dir = run[0]
    acc = _reader(model_dir)
    rows = [(e.step, e.value) for e in acc.Scalars("row_sum")]
    # step s saw rows (s-1)*B .. s*B-1 (the reference: the input order)
    assert rows == [(s, float(np.arange((s - 1) * BATCH, s * BATCH).sum())) for s in range(1, 16)]
    hist = acc.Histograms("rows")
    assert [e.step for e in hist] == list(range(1, 16))
    assert hist[2].histogram_value.min == 2 * BATCH and hist[2].histogram_value.max == 47
    assert hist[2].histogram_value.num == BATCH
    images = acc.Images("rows_image")
    assert [e.step for e in images] == list(range(1, 16))
    assert (images[0].width, images[0].height) == (4, 4)
    texts = acc.Tensors("first_row/text_summary")
    assert [e.step for e in texts] == list(range(1, 16))
    assert texts[6].tensor_proto.string_val[0].decode() == f"first row {6 * BATCH}"


def test_estimator_writes_loss_and_speed_every_save_summary_steps(run):
    model_dir, losses = run[0], run[1]
    acc = _reader(model_dir)
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [5, 10, 15]
    # the reference: the per-step loss hooks receive
    np.testing.assert_allclose([e.value for e in loss], [losses[s] for s in (5, 10, 15)], rtol=1e-6)
    # speed is measured from the end of the first loop (which compiles)
    speed = acc.Scalars("global_step/sec")
    examples = acc.Scalars("examples/sec")
    assert [e.step for e in speed] == [e.step for e in examples] == [10, 15]
    for s, x in zip(speed, examples, strict=True):
        assert s.value > 0
        assert x.value == pytest.approx(s.value * BATCH, rel=1e-5)


def test_eval_results_are_written_under_eval_dirs(run):
    model_dir, _, results, named = run
    for sub, expected in (("eval", results), ("eval_holdout", named)):
        acc = _reader(model_dir / sub)
        assert sorted(acc.Tags()["scalars"]) == ["accuracy", "loss"]
        for tag in ("accuracy", "loss"):
            events = acc.Scalars(tag)
            assert [e.step for e in events] == [STEPS]
            assert events[0].value == pytest.approx(expected[tag], rel=1e-6)
        assert expected["global_step"] == STEPS
    assert results["loss"] != named["loss"]  # two different evaluations, two directories


def test_summary_without_a_current_writer_is_an_error():
    with pytest.raises(RuntimeError, match="host_call"):
        summary.scalar("x", 1.0)


def test_scalar_needs_one_value(tmp_path):
    with summary.record(None, 3), pytest.raises(ValueError, match=r"'x'.*shape \(2,\)"):
        summary.scalar("x", np.zeros(2))


def test_record_writes_at_the_current_or_given_step(tmp_path):
    writer = summary.writer_for(tmp_path)
    with summary.record(writer, 7):
        summary.scalar("a", np.array([2.5]))
        summary.scalar("a", 4.0, step=9)
    summary.close(tmp_path)
    assert [(e.step, e.value) for e in _reader(tmp_path).Scalars("a")] == [(7, 2.5), (9, 4.0)]


class _FakeWriter:
    def __init__(self):
        self.events = []

    def add_scalar(self, tag, value, global_step):
        self.events.append((tag, global_step, value))


def test_train_summaries_measure_speed_between_reports():
    now = [0.0]
    writer = _FakeWriter()
    ts = summary.TrainSummaries(writer, every=4, examples_per_step=32, clock=lambda: now[0])
    for loop in range(4):  # loops of 3 steps, 1.5 s each after a 100 s (compiling) first one
        now[0] += 100.0 if loop == 0 else 1.5
        steps = np.arange(3 * loop + 1, 3 * loop + 4)
        ts.after_loop(steps * 0.1, steps)
    loss = [(s, v) for t, s, v in writer.events if t == "loss"]
    assert loss == [(4, pytest.approx(0.4)), (8, pytest.approx(0.8)), (12, pytest.approx(1.2))]
    speed = [(s, v) for t, s, v in writer.events if t == "global_step/sec"]
    # clock starts at step 3; step 6 (loop 2) crosses 4 -> 3 steps / 1.5 s; step 9 crosses 8
    # -> 3 / 1.5; step 12 crosses 12 -> 3 / 1.5
    assert speed == [(6, 2.0), (9, 2.0), (12, 2.0)]
    assert [(s, v) for t, s, v in writer.events if t == "examples/sec"] == [
        (6, 64.0),
        (9, 64.0),
        (12, 64.0),
    ]


def test_train_summaries_off_when_every_is_zero():
    writer = _FakeWriter()
    ts = summary.TrainSummaries(writer, every=0, examples_per_step=8)
    ts.after_loop(np.ones(4), np.arange(1, 5))
    assert writer.events == []
