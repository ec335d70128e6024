"""host_call: every step's rows, concatenated over replicas, in order, on the host."""

import doctest
import threading
import time
import traceback

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
from estimator.driver import host
from tests import helpers as h

BATCH = 16  # 8 replicas x 2 rows


def _input_fn(params):
    """Batch k holds rows k*B .. k*B+B-1, so the expected host rows are known exactly."""
    x, y = h.make_data(n=BATCH)
    b = params["batch_size"]
    k = 0
    while True:
        yield {"x": x[:b], "row": np.arange(k * b, (k + 1) * b, dtype=np.int32)}, y[:b]
        k += 1


def _model_fn(calls, *, as_dict=False, estimator_spec=False, fail_at=None, sleep=0.0):
    """A linear model whose host_call records what the host receives, per call."""

    def model_fn(features, labels, mode, params):
        logits = nn.Dense(3, name="out")(features["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        gs = jnp.reshape(estimator.get_global_step(), (1,))

        def host_fn(row, loss, gs):
            if sleep:
                time.sleep(sleep)
            calls.append(
                {
                    "row": row.copy(),
                    "loss": loss.copy(),
                    "gs": gs.copy(),
                    "thread": threading.current_thread().name,
                }
            )
            if fail_at is not None and int(gs[0]) + 1 == fail_at:
                raise KeyError(f"host_fn failed at step {fail_at}")

        tensors = [features["row"], loss[None], gs]
        if as_dict:
            tensors = dict(zip(("row", "loss", "gs"), tensors, strict=True))
        spec = estimator.TPUEstimatorSpec(
            mode, loss=loss, train_op=optax.sgd(0.1), host_call=(host_fn, tensors)
        )
        return spec.as_estimator_spec() if estimator_spec else spec

    return model_fn


@pytest.mark.parametrize(
    "ipl, every_n, as_dict",
    [(1, 1, False), (7, 1, True), (7, 3, False)],
    ids=["ipl1", "ipl7-dict", "ipl7-every3"],
)
def test_host_call_gets_every_steps_rows_in_order(tmp_path, ipl, every_n, as_dict):
    calls = []
    est = h.make_estimator(
        tmp_path,
        _model_fn(calls, as_dict=as_dict),
        ipl=ipl,
        tpu={"host_call_every_n_steps": every_n},
    )
    est.train(_input_fn, max_steps=10)

    called = [s for s in range(1, 11) if s % every_n == 0]  # global step after the step
    assert [int(c["gs"][0]) + 1 for c in calls] == called
    for c, step in zip(calls, called, strict=True):
        # replica r's 2 rows are rows 2r, 2r+1 of the global batch: concatenated in order
        np.testing.assert_array_equal(c["row"], np.arange((step - 1) * BATCH, step * BATCH))
        # a [1] tensor comes back once per replica, and each replica's value is that of
        # the global step it ran
        assert c["loss"].shape == (8,) and c["gs"].shape == (8,)
        np.testing.assert_array_equal(c["gs"], np.full(8, step - 1))
        assert c["thread"] != threading.main_thread().name


def test_rows_match_what_one_device_sees(tmp_path):
    """use_tpu=False with as_estimator_spec(): the same rows, steps and (mean) loss."""
    replicated, single = [], []
    h.make_estimator(tmp_path / "8", _model_fn(replicated), ipl=3).train(_input_fn, max_steps=5)
    h.make_estimator(
        tmp_path / "1", _model_fn(single, estimator_spec=True), ipl=3, use_tpu=False
    ).train(_input_fn, max_steps=5)
    assert len(single) == len(replicated) == 5
    for one, many in zip(single, replicated, strict=True):
        np.testing.assert_array_equal(one["row"], many["row"])
        assert one["loss"].shape == (1,)
        # the global-batch loss is the mean of the replicas' losses (equal shard sizes)
        np.testing.assert_allclose(one["loss"][0], many["loss"].mean(), rtol=1e-5)


def test_train_returns_after_every_host_call(tmp_path):
    calls = []
    est = h.make_estimator(tmp_path, _model_fn(calls, sleep=0.05), ipl=4)
    est.train(_input_fn, max_steps=12)
    assert [int(c["gs"][0]) + 1 for c in calls] == list(range(1, 13))


def test_host_call_error_stops_training_with_original_traceback(tmp_path):
    calls = []
    est = h.make_estimator(tmp_path, _model_fn(calls, fail_at=3, sleep=0.01), ipl=2)
    with pytest.raises(KeyError, match="host_fn failed at step 3") as info:
        est.train(_input_fn, max_steps=400)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "host_fn" in frames  # raised where the user's function raised it
    assert frames[0] == "test_host_call_error_stops_training_with_original_traceback"
    # no host call ran after the failing one, and training stopped long before max_steps
    assert [int(c["gs"][0]) + 1 for c in calls] == [1, 2, 3]
    latest = est.latest_checkpoint()
    assert latest is None or int(latest.rsplit("/", 1)[-1]) < 400


def test_host_fn_capturing_a_traced_value_is_a_clear_error(tmp_path):
    def model_fn(features, labels, mode, params):
        logits = nn.Dense(3)(features["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        def host_fn(row):
            estimator.summary.scalar("logit_mean", np.mean(logits))  # logits is traced

        return estimator.TPUEstimatorSpec(
            mode, loss=loss, train_op=optax.sgd(0.1), host_call=(host_fn, [features["row"]])
        )

    est = h.make_estimator(tmp_path, model_fn, ipl=2)
    with pytest.raises(estimator.TracedValueError, match=r"host_call captures 'logits'"):
        est.train(_input_fn, max_steps=2)


def test_traced_value_guard_names_the_function():
    """A value reached some other way (not a closure) still gives a clear error."""
    import jax

    leaked = []
    jax.jit(lambda x: leaked.append(x) or x)(1.0)

    class Box:  # an object jax does not look into
        value = leaked[0]

    with pytest.raises(estimator.TracedValueError, match="host_call uses a value computed"):
        host.call_host_fn(lambda: float(Box.value), [], what="host_call")


def test_worker_skips_everything_after_an_error():
    worker = host.HostWorker()
    ran = []
    worker.submit(lambda: ran.append(1))
    worker.submit(lambda: 1 / 0)
    worker.submit(lambda: ran.append(3))
    with pytest.raises(ZeroDivisionError):
        worker.join()
    worker.submit(lambda: ran.append(4))  # still skipped: host work stopped for good
    worker.join()
    worker.close()
    assert ran == [1]
    assert worker.failed


def test_module_docstring_example():
    result = doctest.testmod(host, optionflags=doctest.ELLIPSIS)
    assert result.attempted and result.failed == 0
