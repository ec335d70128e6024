"""Input pipelines: which rows each replica gets, input formats, prefetch, shape/dtype checks."""

import threading
import time

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
import metrics
from estimator import InputPipelineConfig as IPC
from tests import helpers as h

R = 8


def _recording_model_fn(seen: list):
    """Training model whose host_call reports each replica's rows and the replica id."""

    def host_fn(rows, replica, step):
        seen.append((int(step[0]), np.asarray(rows), np.asarray(replica)))

    def model_fn(features, labels, mode, params):
        rows = features["row"]
        pred = nn.Dense(1)(rows[:, None].astype(jnp.float32))[:, 0]
        replica = estimator.get_replica_context().replica_id_in_sync_group
        if mode == estimator.ModeKeys.PREDICT:
            return estimator.TPUEstimatorSpec(
                mode, predictions={"row": rows, "replica": jnp.full(rows.shape, replica)}
            )
        loss = jnp.mean((pred - labels) ** 2)
        return estimator.TPUEstimatorSpec(
            mode,
            loss=loss,
            train_op=optax.sgd(0.0),
            host_call=(
                host_fn,
                [
                    rows,
                    jnp.full(rows.shape, replica),
                    jnp.reshape(estimator.get_global_step(), (1,)),
                ],
            ),
            eval_metrics=(_collect_rows, [rows]),
        )

    return model_fn


def _sorted_rows(rows):
    return np.sort(rows)


def _collect_rows(row):
    return {"rows": metrics.collecting(_sorted_rows, row)}


def _stream(calls: list):
    """An input_fn over the integers 0, 1, 2, ... recording the batch size it was asked for."""

    def input_fn(params, input_context):
        calls.append((params["batch_size"], input_context))
        b, start = params["batch_size"], 0
        while True:
            rows = np.arange(start, start + b, dtype=np.int32)
            yield {"row": rows}, rows.astype(np.float32)
            start += b

    return input_fn


MODES = [
    # mode, rows input_fn is asked for, rows model_fn sees per replica
    (IPC.PER_HOST_V1, 32, 4),
    (IPC.PER_HOST_V2, 4, 4),
    (IPC.PER_SHARD_V1, 4, 4),
    (IPC.BROADCAST, 32, 32),
]


@pytest.mark.parametrize("mode,input_batch,replica_batch", MODES)
def test_each_replica_gets_its_slice_of_the_stream(tmp_path, mode, input_batch, replica_batch):
    seen, calls = [], []
    est = estimator.TPUEstimator(
        _recording_model_fn(seen),
        config=h.config(tmp_path, iterations_per_loop=3, tpu={"per_host_input_for_training": mode}),
        train_batch_size=32,
    )
    est.train(_stream(calls), max_steps=3)
    assert len(calls) == 1 and calls[0][0] == input_batch
    ctx = calls[0][1]
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, R)
    assert [s for s, _, _ in seen] == [0, 1, 2]
    for step, rows, replica in seen:
        assert len(rows) == R * replica_batch
        for r in range(R):
            got = rows[replica == r]
            if mode == IPC.BROADCAST:  # every replica sees the whole global batch
                expected = np.arange(32 * step, 32 * step + 32)
            else:  # replica r gets rows [r * b, (r + 1) * b) of the step's global batch
                expected = np.arange(32 * step + r * 4, 32 * step + (r + 1) * 4)
            np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("mode", [IPC.PER_HOST_V1, IPC.PER_HOST_V2, IPC.BROADCAST])
def test_eval_and_predict_see_every_example_once_in_each_mode(tmp_path, mode):
    seen = []
    est = estimator.TPUEstimator(
        _recording_model_fn(seen),
        config=h.config(tmp_path, iterations_per_loop=2, tpu={"per_host_input_for_training": mode}),
        train_batch_size=32,
        eval_batch_size=32,
        predict_batch_size=32,
    )
    est.train(_stream([]), max_steps=1)
    n = 75

    def finite(params):
        b = params["batch_size"]
        for i in range(0, n, b):
            rows = np.arange(i, min(i + b, n), dtype=np.int32)
            yield {"row": rows}, rows.astype(np.float32)

    np.testing.assert_array_equal(est.evaluate(finite)["rows"], np.arange(n))
    preds = list(est.predict(lambda params: (f for f, _ in finite(params))))
    assert [int(p["row"]) for p in preds] == list(range(n))


def _features(batch):
    return batch


FORMATS = {
    "dict features, labels": lambda x, y: ({"x": x}, y),
    "array features, labels": lambda x, y: (x, y),
    "nested features": lambda x, y: ({"x": x, "extra": {"y2": y}}, y),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_input_formats_train_the_same(tmp_path, name):
    x, y = h.make_data()
    make = FORMATS[name]

    def model_fn(features, labels, mode, params):
        f = features["x"] if isinstance(features, dict) else features
        return h.model_fn({"x": f}, labels, mode, params)

    def input_fn(params):
        b = params["batch_size"]
        return [make(x[i : i + b], y[i : i + b]) for i in range(0, 64, b)]

    est = estimator.TPUEstimator(model_fn, config=h.config(tmp_path / name), train_batch_size=16)
    est.train(input_fn)
    ref = estimator.TPUEstimator(h.model_fn, config=h.config(tmp_path / "ref"), train_batch_size=16)
    ref.train(h.train_input_fn(x, y), max_steps=4)
    h.assert_params_close(h.params_of(est), h.params_of(ref), rtol=1e-6, atol=1e-7)


class _Dataset:
    """Stands for a tf.data.Dataset: only offers as_numpy_iterator()."""

    def __init__(self, batches):
        self.batches = batches

    def as_numpy_iterator(self):
        return iter(self.batches)


def test_as_numpy_iterator_and_features_only_predict(tmp_path):
    x, y = h.make_data()
    est = estimator.TPUEstimator(
        h.model_fn, config=h.config(tmp_path), train_batch_size=16, predict_batch_size=16
    )
    est.train(lambda params: _Dataset([({"x": x[:16]}, y[:16])] * 3))
    assert est.get_variable_value("global_step") == 3
    preds = list(est.predict(lambda params: _Dataset([{"x": x[:16]}, {"x": x[16:20]}])))
    assert len(preds) == 20


def test_input_fn_errors_surface_with_their_traceback(tmp_path):
    def input_fn(params):
        yield {"x": np.zeros((16, 6), np.float32)}, np.zeros(16, np.int32)
        raise RuntimeError("disk on fire")

    est = estimator.TPUEstimator(
        h.model_fn, config=h.config(tmp_path, iterations_per_loop=1), train_batch_size=16
    )
    with pytest.raises(RuntimeError, match="disk on fire") as info:
        est.train(input_fn, max_steps=5)
    assert any(t.name == "input_fn" for t in info.traceback)


SHAPE_ERRORS = [
    (
        "changed feature shape",
        lambda i: ({"x": np.zeros((16, 6 if i == 0 else 5), np.float32)}, np.zeros(16, np.int32)),
        ValueError,
        r"\['x'\].*\(16, 5\)",
    ),
    (
        "too many rows",
        lambda i: (
            {"x": np.zeros((16 if i == 0 else 32, 6), np.float32)},
            np.zeros(16 if i == 0 else 32, np.int32),
        ),
        ValueError,
        "32 rows",
    ),
    (
        "uncastable dtype",
        lambda i: (
            {"x": np.zeros((16, 6), np.float32 if i == 0 else np.complex64)},
            np.zeros(16, np.int32),
        ),
        TypeError,
        "complex64",
    ),
    (
        "structure change",
        lambda i: (
            {"x": np.zeros((16, 6), np.float32)}
            if i == 0
            else {"z": np.zeros((16, 6), np.float32)},
            np.zeros(16, np.int32),
        ),
        ValueError,
        "structure",
    ),
    (
        "mismatched rows",
        lambda i: ({"x": np.zeros((16, 6), np.float32)}, np.zeros(16 if i == 0 else 8, np.int32)),
        ValueError,
        "rows",
    ),
]


@pytest.mark.parametrize(
    "make,error,match", [c[1:] for c in SHAPE_ERRORS], ids=[c[0] for c in SHAPE_ERRORS]
)
def test_shape_and_dtype_errors_name_the_entry(tmp_path, make, error, match):
    est = estimator.TPUEstimator(
        h.model_fn, config=h.config(tmp_path, iterations_per_loop=1), train_batch_size=16
    )
    with pytest.raises(error, match=match):
        est.train(lambda params: (make(i) for i in range(3)), max_steps=3)


def test_castable_dtype_is_converted_without_recompiling(tmp_path):
    x, y = h.make_data()

    def input_fn(params):  # float64 / int64 everywhere, then float16 on one batch
        for i in range(4):
            xs = x[16 * i : 16 * i + 16].astype(np.float16 if i == 2 else np.float64)
            yield {"x": xs}, y[16 * i : 16 * i + 16].astype(np.int64)

    est = estimator.TPUEstimator(
        h.model_fn, config=h.config(tmp_path, iterations_per_loop=1), train_batch_size=16
    )
    est.train(input_fn)
    assert est.get_variable_value("global_step") == 4


def test_slow_input_overlaps_with_compute(tmp_path):
    """The next loop's batches are read while the current loop runs."""
    x, y = h.make_data()
    events = []
    lock = threading.Lock()

    def input_fn(params):
        for i in range(6):
            time.sleep(0.05)
            with lock:
                events.append(("read", i, time.monotonic()))
            yield {"x": x[:16]}, y[:16]

    def model_fn(features, labels, mode, params):
        spec = h.model_fn(features, labels, mode, params)
        spec.host_call = (
            lambda s: events.append(("host", int(s[0]), time.monotonic())),
            [jnp.reshape(estimator.get_global_step(), (1,))],
        )
        return spec

    est = estimator.TPUEstimator(
        model_fn, config=h.config(tmp_path, iterations_per_loop=2), train_batch_size=16
    )
    est.train(input_fn)
    reads = [t for kind, _, t in events if kind == "read"]
    hosts = {s: t for kind, s, t in events if kind == "host"}
    assert len(reads) == 6 and sorted(hosts) == [0, 1, 2, 3, 4, 5]
    # Batches 2-3 (the second loop) were read before the first loop's results reached the
    # host: the reader runs ahead of the device instead of waiting for it.
    assert reads[3] < hosts[1]
