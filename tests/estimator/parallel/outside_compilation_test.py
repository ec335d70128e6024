"""outside_compilation: host functions inside model_fn and TPUStrategy.run, and outside them."""

import collections
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
from estimator.parallel.outside_compilation import outside_compilation
from estimator.strategy.strategy import PerReplica, TPUStrategy
from tests import helpers as h


def parse_one(x):
    """The issue's example: format "1{}" with each input and parse it back to a number."""
    digits = [int(v) for v in np.asarray(x).reshape(-1)]
    return np.array(
        [float("1{}".format(d)) for d in digits],  # noqa: UP032 - as in the issue
        np.float32,
    ).reshape(np.shape(x))


def test_plain_call_outside_a_replicated_computation():
    assert outside_compilation(parse_one, np.int32(1)) == 11.0
    assert outside_compilation(lambda a, *, b: a + b, 2, b=3) == 5
    # Under a user's own jit (not replicated) it is a plain traced call, as TF's was.
    assert float(jax.jit(lambda x: outside_compilation(jnp.square, x))(3.0)) == 9.0


def _string_model_fn(features, labels, mode, params):
    x = features["x"]
    logits = nn.Dense(2)(x)
    parsed = outside_compilation(parse_one, features["digit"])  # shape inferred by a dry run
    return estimator.TPUEstimatorSpec(mode, predictions={"parsed": parsed, "logits": logits})


def _train_once(est, x):
    """Predict needs a checkpoint: train one step of a model_fn with the same variables."""
    est.train(
        lambda params: iter([({"x": x[: params["batch_size"]]}, x[: params["batch_size"]])]),
        steps=1,
    )


def _predict_spec_or_train(model_fn):
    def wrapped(features, labels, mode, params):
        if mode == estimator.ModeKeys.PREDICT:
            return model_fn(features, labels, mode, params)
        logits = nn.Dense(2)(features["x"])
        return estimator.TPUEstimatorSpec(mode, loss=jnp.mean(logits**2), train_op=optax.sgd(0.0))

    return wrapped


@pytest.mark.parametrize("use_tpu", [True, False])
def test_string_example_inside_model_fn_returns_eleven_for_one(tmp_path, use_tpu):
    est = estimator.TPUEstimator(
        _predict_spec_or_train(_string_model_fn),
        config=h.config(tmp_path),
        use_tpu=use_tpu,
        train_batch_size=16,
        predict_batch_size=16,
    )
    x = np.ones((16, 3), np.float32)
    _train_once(est, x)
    digits = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9] * 3, np.int32)  # 27 rows: last batch padded

    def input_fn(params):
        b = params["batch_size"]
        for i in range(0, len(digits), b):
            yield {
                "x": np.ones((len(digits[i : i + b]), 3), np.float32),
                "digit": digits[i : i + b],
            }

    got = np.array([p["parsed"] for p in est.predict(input_fn)])
    np.testing.assert_array_equal(got, [float(f"1{d}") for d in digits])
    assert got[0] == 11.0


class _Recorder:
    def __init__(self):
        self.calls = []
        self.threads = set()
        self._active = 0
        self.overlapped = False

    def __call__(self, replica, step, rows):
        self._active += 1
        self.overlapped |= self._active > 1  # would be set if two calls ran at once
        self.calls.append((int(replica), int(step), np.asarray(rows).copy()))
        self.threads.add(threading.get_ident())
        self._active -= 1
        return np.asarray(rows, np.float32).sum(axis=1)


@pytest.mark.parametrize("cores", [1, 2])
def test_train_calls_host_once_per_replica_per_step_and_returns_its_result(tmp_path, cores):
    rec = _Recorder()
    host_seen = []

    def host_fn(host_sum, row_sum):
        host_seen.append((np.asarray(host_sum).copy(), np.asarray(row_sum).copy()))

    def model_fn(features, labels, mode, params):
        x = features["x"]
        step = estimator.get_global_step()
        sums = outside_compilation(
            rec,
            jax.lax.axis_index("data"),
            step,
            x,
            result_shape=jax.ShapeDtypeStruct((x.shape[0],), jnp.float32),
        )
        logits = nn.Dense(3)(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return estimator.TPUEstimatorSpec(
            mode,
            loss=loss + 0.0 * sums.sum(),
            train_op=optax.sgd(0.1),
            host_call=(host_fn, [sums, x.sum(axis=1)]),
        )

    x, y = h.make_data(n=64)
    cfg = h.config(tmp_path, iterations_per_loop=4, tpu={"num_cores_per_replica": cores})
    est = estimator.TPUEstimator(model_fn, config=cfg, train_batch_size=16)
    est.train(h.train_input_fn(x, y), steps=6)
    replicas = est.num_replicas
    assert replicas == 8 // cores
    rows_per_replica = 16 // replicas
    assert len(rec.calls) == replicas * 6
    assert collections.Counter((r, s) for r, s, _ in rec.calls) == {
        (r, s): 1 for r in range(replicas) for s in range(6)
    }
    # Each call saw only its own replica's rows of batch s (the input cycles over x).
    for r, s, rows in rec.calls:
        start = (s * 16) % 64 + rows_per_replica * r
        np.testing.assert_array_equal(rows, x[start : start + rows_per_replica])
    assert not rec.overlapped
    # What the host returned came back into the device computation, per replica.
    assert len(host_seen) == 6
    for host_sum, row_sum in host_seen:
        np.testing.assert_allclose(host_sum, row_sum, rtol=1e-6)


def test_gradients_are_unchanged_by_a_host_computation(tmp_path):
    def make_model_fn(with_host):
        def model_fn(features, labels, mode, params):
            logits = nn.Dense(3, name="out")(features["x"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            if with_host:  # the host value depends on the params; no gradient flows through it
                loss = loss + outside_compilation(lambda v: np.float32(np.sum(v)), logits)
            return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.5))

        return model_fn

    x, y = h.make_data(n=64)
    runs = []
    for with_host in (False, True):
        est = estimator.TPUEstimator(
            make_model_fn(with_host),
            config=h.config(tmp_path / str(with_host)),
            train_batch_size=16,
        )
        est.train(h.train_input_fn(x, y), steps=4)
        runs.append(h.params_of(est))
    h.assert_params_close(runs[0], runs[1], rtol=1e-6, atol=1e-7)


def test_eval_calls_host_once_per_replica_per_step(tmp_path):
    calls = []

    def model_fn(features, labels, mode, params):
        logits = nn.Dense(3)(features["x"])
        outside_compilation(
            lambda r: calls.append(int(r)), jax.lax.axis_index("data"), result_shape=None
        )
        mask = estimator.padding_mask()
        per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return estimator.TPUEstimatorSpec(
            mode, loss=(per_row * mask).sum() / mask.sum(), train_op=optax.sgd(0.1)
        )

    x, y = h.make_data(n=64)
    est = estimator.TPUEstimator(
        model_fn, config=h.config(tmp_path), train_batch_size=16, eval_batch_size=16
    )
    est.train(h.train_input_fn(x, y), steps=1)
    calls.clear()
    est.evaluate(h.eval_input_fn(x, y), steps=3)
    assert sorted(collections.Counter(calls).items()) == [(r, 3) for r in range(8)]


def test_strategy_run_calls_host_per_replica_with_its_value():
    strategy = TPUStrategy()
    seen = []

    def host(v):
        seen.append(np.asarray(v).copy())
        return np.asarray(v) * 10 + 1

    def step(v):
        return outside_compilation(host, v)

    values = PerReplica.from_stacked(jnp.arange(8 * 2, dtype=jnp.float32).reshape(8, 2))
    out = strategy.run(step, args=(values,))
    got = np.stack([np.asarray(v) for v in strategy.experimental_local_results(out)])
    np.testing.assert_array_equal(got, np.arange(16).reshape(8, 2) * 10 + 1)
    # One dry run at trace time (on zeros) to infer the result shape, then one call per replica.
    assert len(seen) == 9
    np.testing.assert_array_equal(seen[0], np.zeros(2))
    assert sorted(tuple(s) for s in seen[1:]) == [(2.0 * r, 2.0 * r + 1) for r in range(8)]


def test_uninferable_result_shape_is_a_clear_error():
    strategy = TPUStrategy()

    def needs_nonzero(v):
        return np.float32(1.0 / int(np.asarray(v).ravel()[0]))

    with pytest.raises(ValueError, match="could not infer the result shape.*result_shape="):
        strategy.run(lambda v: outside_compilation(needs_nonzero, v), args=(jnp.ones(2),))
    # Declaring it avoids the dry run.
    out = strategy.run(
        lambda v: outside_compilation(
            needs_nonzero, v, result_shape=jax.ShapeDtypeStruct((), jnp.float32)
        ),
        args=(jnp.ones(2),),
    )
    assert [float(v) for v in strategy.experimental_local_results(out)] == [1.0] * 8


def test_wrong_declared_shape_names_both_shapes():
    strategy = TPUStrategy()
    with pytest.raises(Exception, match=r"returned shape \(3,\).*declares \(2,\)"):
        out = strategy.run(
            lambda v: outside_compilation(
                lambda a: np.zeros(3, np.float32),
                v,
                result_shape=jax.ShapeDtypeStruct((2,), jnp.float32),
            ),
            args=(jnp.ones(2),),
        )
        jax.block_until_ready(out)
    # The failure does not linger: the next host computation on these devices runs, and
    # JAX's effects barrier (also run at exit) is clean again.
    out = strategy.run(lambda v: outside_compilation(lambda a: a + 1, v), args=(jnp.ones(2),))
    np.testing.assert_array_equal(np.asarray(strategy.experimental_local_results(out)[0]), [2, 2])
    jax.effects_barrier()
