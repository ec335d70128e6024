"""``ema.apply(var_list)`` in TF's control-dependency form (issue 41, item 7): EfficientNet's
and MnasNet's moving averages of the trainable variables and BatchNorm's statistics, against
numpy references: the averages over the same steps (one device and 8 replicas), bitwise
resume, evaluation and prediction with ``variables_to_restore`` (and ``use_for_eval``), the
port's changed lines, and float16, micro-batches and the sharded modes."""

from __future__ import annotations

import inspect
import re

import flax.linen as nn
import numpy as np
import optax
import pytest

import estimator
from estimator.engine.averages import VariablesAverageState
from tests import helpers as h

X, Y = h.make_data(n=64)
AVG = "ExponentialMovingAverage"
PARAMS = ["hidden/kernel", "hidden/bias", "BatchNorm_0/scale", "BatchNorm_0/bias"]
PARAMS += ["out/kernel", "out/bias"]
STATS = ["batch_stats/BatchNorm_0/mean", "batch_stats/BatchNorm_0/var"]
EPS = 1e-5  # Flax BatchNorm's epsilon


# --- The TF program's lines (tensorflow/tpu models/official/efficientnet: utils.py, main.py)
TF_SOURCE = """
def get_ema_vars():
  ema_vars = tf.trainable_variables() + tf.get_collection('moving_vars')
  for v in tf.global_variables():
    if 'moving_mean' in v.name or 'moving_variance' in v.name:
      ema_vars.append(v)
  return list(set(ema_vars))

def ema_train_op(optimizer, loss, global_step, decay):
  ema = tf.train.ExponentialMovingAverage(decay=decay, num_updates=global_step)
  ema_vars = get_ema_vars()
  update_ops = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
  with tf.control_dependencies(update_ops):
    train_op = optimizer.minimize(loss, global_step)
  with tf.control_dependencies([train_op]):
    train_op = ema.apply(ema_vars)
  return train_op
"""


# --- ... and their port: the namespace, and minimize -> the optax optimizer.
def get_ema_vars():
    ema_vars = estimator.trainable_variables() + estimator.get_collection("moving_vars")
    for v in estimator.global_variables():
        if "moving_mean" in v.name or "moving_variance" in v.name:
            ema_vars.append(v)
    return list(set(ema_vars))


def ema_train_op(optimizer, loss, global_step, decay):
    ema = estimator.ExponentialMovingAverage(decay=decay, num_updates=global_step)
    ema_vars = get_ema_vars()
    update_ops = estimator.get_collection(estimator.GraphKeys.UPDATE_OPS)
    with estimator.control_dependencies(update_ops):
        train_op = optimizer
    with estimator.control_dependencies([train_op]):
        train_op = ema.apply(ema_vars)
    return train_op


def _normalised(source: str) -> list[str]:
    source = source.replace("tf.train.", "estimator.").replace("tf.", "estimator.")
    return [re.sub(r"\s+", "", line).replace("'", '"') for line in source.strip().splitlines()]


def test_the_port_changes_one_line():
    ported = inspect.getsource(get_ema_vars) + "\n" + inspect.getsource(ema_train_op)
    tf, port = _normalised(TF_SOURCE), _normalised(ported)
    assert len(tf) == len(port)
    changed = [(a, b) for a, b in zip(tf, port, strict=True) if a != b]
    assert changed == [("train_op=optimizer.minimize(loss,global_step)", "train_op=optimizer")]


def make_model_fn(*, decay=0.5, lr=0.5, use_for_eval=False, saver=True):
    """An MLP with a BatchNorm, trained and evaluated as EfficientNet's model_fn does."""

    def model_fn(features, labels, mode, params):
        training = mode == estimator.ModeKeys.TRAIN
        x = nn.Dense(16, name="hidden")(features["x"])
        x = nn.BatchNorm(use_running_average=not training, momentum=0.9, axis_name="data")(x)
        logits = nn.Dense(3, name="out")(nn.relu(x))
        if mode == estimator.ModeKeys.PREDICT:
            return estimator.TPUEstimatorSpec(
                mode, predictions={"logits": logits}, scaffold_fn=_scaffold(get_ema_vars())
            )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        global_step = estimator.get_global_step()
        if training:
            if use_for_eval:  # the native route: no EVAL branch
                ema = estimator.ExponentialMovingAverage(decay, global_step, use_for_eval=True)
                with estimator.control_dependencies([optax.sgd(lr)]):
                    train_op = ema.apply(get_ema_vars())
            else:
                train_op = ema_train_op(optax.sgd(lr), loss, global_step, decay)
            return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=train_op)
        return estimator.TPUEstimatorSpec(
            mode,
            loss=loss,
            eval_metrics=(h.metric_fn, [labels, logits]),
            scaffold_fn=_scaffold(get_ema_vars()) if saver else None,
        )

    return model_fn


def _scaffold(ema_vars):
    # EfficientNet's EVAL: restore_vars_dict = ema.variables_to_restore(ema_vars)
    ema = estimator.ExponentialMovingAverage(decay=0.5)
    restore_vars_dict = ema.variables_to_restore(ema_vars)
    return lambda: estimator.Scaffold(saver=estimator.Saver(restore_vars_dict))


def _est(path, **kw):
    use_tpu = kw.pop("use_tpu", True)
    ipl, tpu = kw.pop("ipl", 1), kw.pop("tpu", {})
    return h.make_estimator(path, make_model_fn(**kw), ipl=ipl, use_tpu=use_tpu, tpu=tpu)


def _values(est, names):
    return {n: np.asarray(est.get_variable_value(n), np.float64) for n in names}


def _shadows(est):
    return _values(est, [f"{n}/{AVG}" for n in PARAMS + STATS])


@pytest.fixture(scope="module")
def initial(tmp_path_factory):
    """The initial parameters (one step at learning rate 0) and statistics (Flax's 0 and 1)."""
    est = _est(tmp_path_factory.mktemp("init") / "r", lr=0.0)
    est.train(h.train_input_fn(X, Y), max_steps=1)
    values = _values(est, PARAMS)
    for name in STATS:
        values[name] = (np.ones if name.endswith("var") else np.zeros)(16)
    return values


def _train_with_reference(est, initial, steps, decay=0.5):
    """Trains ``steps`` steps one at a time; returns the numpy moving averages of every
    variable (TF's rule with num_updates=global_step) over the values after each step."""
    shadow = dict(initial)
    for step in range(1, steps + 1):
        est.train(h.train_input_fn(X, Y), max_steps=step)
        d = min(decay, (1 + step) / (10 + step))
        raw = _values(est, PARAMS + STATS)
        shadow = {n: d * shadow[n] + (1 - d) * raw[n] for n in shadow}
    return {f"{n}/{AVG}": v for n, v in shadow.items()}


def _assert_close(got, want, **tol):
    assert sorted(got) == sorted(want)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], err_msg=n, **tol)


@pytest.mark.parametrize("use_tpu", [False, True], ids=["one_device", "eight_replicas"])
def test_averages_of_parameters_and_statistics_match_numpy(tmp_path, initial, use_tpu):
    est = _est(tmp_path / "run", use_tpu=use_tpu)
    expected = _train_with_reference(est, initial, 4)
    _assert_close(_shadows(est), expected, rtol=2e-6, atol=1e-7)
    assert not np.allclose(  # the statistics moved, and their averages lag behind
        expected[f"{STATS[0]}/{AVG}"], _values(est, STATS)[STATS[0]], atol=1e-3
    )
    assert isinstance(est._job.store.last.state.opt_state, VariablesAverageState)
    listed = dict(estimator.list_variables(str(tmp_path / "run")))
    assert listed[f"batch_stats/BatchNorm_0/var/{AVG}"] == [16]


def test_eight_replicas_equal_one_device(tmp_path):
    one, eight = _est(tmp_path / "one", use_tpu=False), _est(tmp_path / "eight")
    for est in (one, eight):
        est.train(h.train_input_fn(X, Y), max_steps=4)
    _assert_close(_shadows(eight), _shadows(one), rtol=1e-5, atol=1e-6)


def test_resume_is_bitwise(tmp_path):
    straight = _est(tmp_path / "straight", ipl=2)
    straight.train(h.train_input_fn(X, Y), max_steps=6)
    _est(tmp_path / "resumed", ipl=2).train(h.train_input_fn(X, Y), max_steps=2)
    _est(tmp_path / "resumed", ipl=2).train(h.train_input_fn(X, Y), max_steps=6)
    a, b = h.params_of(straight), h.params_of(_est(tmp_path / "resumed", ipl=2))
    assert sorted(a) == sorted(b) and f"batch_stats/BatchNorm_0/mean/{AVG}" in a
    for n in a:
        assert np.array_equal(a[n], b[n]), n


def _numpy_logits(values: dict, x: np.ndarray, suffix: str = "") -> np.ndarray:
    """The model in numpy (BatchNorm with the given statistics), float64."""
    v = {n: values[n + suffix] for n in PARAMS + STATS}
    hdn = x @ v["hidden/kernel"] + v["hidden/bias"]
    mean, var = v["batch_stats/BatchNorm_0/mean"], v["batch_stats/BatchNorm_0/var"]
    hdn = (hdn - mean) / np.sqrt(var + EPS) * v["BatchNorm_0/scale"] + v["BatchNorm_0/bias"]
    return np.maximum(hdn, 0) @ v["out/kernel"] + v["out/bias"]


def _numpy_loss(logits: np.ndarray, labels: np.ndarray) -> float:
    shifted = logits - logits.max(1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
    return float(-logp[np.arange(len(labels)), labels].mean())


@pytest.mark.parametrize("route", ["variables_to_restore", "use_for_eval"])
def test_evaluation_and_prediction_read_the_averages(tmp_path, route):
    kw = {"use_for_eval": True, "saver": False} if route == "use_for_eval" else {}
    est = _est(tmp_path / "run", ipl=2, **kw)
    est.train(h.train_input_fn(X, Y), max_steps=4)
    values = {**_shadows(est), **_values(est, PARAMS + STATS)}
    averaged = _numpy_loss(_numpy_logits(values, X, f"/{AVG}"), Y)
    raw = _numpy_loss(_numpy_logits(values, X), Y)
    assert abs(averaged - raw) > 1e-3  # the averages make a difference here
    assert np.abs(values[f"{STATS[0]}/{AVG}"]).max() > 1e-3  # moved from the initial zeros
    for run in (est, _est(tmp_path / "run", ipl=2, **kw)):  # in memory, and from disk
        got = run.evaluate(h.eval_input_fn(X, Y))["loss"]
        assert got == pytest.approx(averaged, rel=1e-5), run
    predicted = np.stack([p["logits"] for p in est.predict(h.eval_input_fn(X))])
    np.testing.assert_allclose(predicted, _numpy_logits(values, X, f"/{AVG}"), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "tpu",
    [
        {"compute_dtype": "float16"},
        {"num_microbatches": 2},
        {"shard_optimizer_state": True},
        {"shard_params": True},
    ],
    ids=["float16", "microbatches", "zero", "fsdp"],
)
def test_precision_microbatches_and_sharded_state(tmp_path, initial, tpu):
    est = _est(tmp_path / "run", tpu=tpu)
    expected = _train_with_reference(est, initial, 3)
    # the reference averages this run's own values: float16 compute, ghost batches and split
    # state change what is averaged, not how
    _assert_close(_shadows(est), expected, rtol=2e-6, atol=1e-7)


def _model_fn_applying(make_train_op):
    def model_fn(features, labels, mode, params):
        x = nn.Dense(4, name="hidden")(features["x"])
        x = nn.BatchNorm(use_running_average=False, axis_name="data")(x)
        logits = nn.Dense(3, name="out")(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=make_train_op())

    return model_fn


def _train_once(path, make_train_op):
    est = h.make_estimator(path, _model_fn_applying(make_train_op), ipl=1)
    return est.train(h.train_input_fn(X, Y), max_steps=1)


def test_a_chosen_subset_is_averaged_and_none_means_the_trainable_variables(tmp_path):
    def subset():
        ema = estimator.ExponentialMovingAverage(0.5)
        chosen = estimator.trainable_variables("out") + [
            v for v in estimator.global_variables() if "moving_mean" in v.name
        ]
        with estimator.control_dependencies([optax.sgd(0.1)]):
            return ema.apply(chosen)

    def every_trainable():
        with estimator.control_dependencies(optax.sgd(0.1)):  # one transformation, unlisted
            return estimator.ExponentialMovingAverage(0.5).apply()

    names = {}
    for name, make in (("subset", subset), ("trainable", every_trainable)):
        est = _train_once(tmp_path / name, make)
        names[name] = sorted(n for n in est.get_variable_names() if n.endswith(AVG))
    assert names["subset"] == [
        f"batch_stats/BatchNorm_0/mean/{AVG}",
        f"out/bias/{AVG}",
        f"out/kernel/{AVG}",
    ]
    assert names["trainable"] == sorted(
        f"{n}/{AVG}"
        for n in ["hidden/kernel", "hidden/bias", "BatchNorm_0/scale"]
        + ["BatchNorm_0/bias", "out/kernel", "out/bias"]
    )


@pytest.mark.parametrize(
    "make_train_op, match",
    [
        (
            lambda: estimator.ExponentialMovingAverage(0.5).apply(estimator.trainable_variables()),
            r"inside `with estimator.control_dependencies\(\[train_op\]\):`",
        ),
        (
            lambda: _under([optax.sgd(0.1), optax.adam(0.1)], ["out/kernel"]),
            "control_dependencies holds 2 optimizers",
        ),
        (lambda: _under([optax.sgd(0.1)], ["dense/kernel"]), "no variable named 'dense/kernel'"),
    ],
    ids=["no_control_dependencies", "two_optimizers", "unknown_name"],
)
def test_mistakes_are_named(tmp_path, make_train_op, match):
    with pytest.raises(ValueError, match=match):
        _train_once(tmp_path / "run", make_train_op)


def _under(control_inputs, var_list):
    with estimator.control_dependencies(control_inputs):
        return estimator.ExponentialMovingAverage(0.5).apply(var_list)


def test_apply_of_a_variable_list_outside_model_fn_is_refused():
    with estimator.control_dependencies([optax.sgd(0.1)]):
        with pytest.raises(ValueError, match="inside model_fn"):
            estimator.ExponentialMovingAverage(0.5).apply(["out/kernel"])
    with pytest.raises(TypeError, match="GradientTransformation or a list of variables"):
        estimator.ExponentialMovingAverage(0.5).apply("out/kernel")


def test_control_dependencies_nest_and_none_clears():
    from estimator.weights.moving_average import _CONTROL

    tx = optax.sgd(0.1)
    with estimator.control_dependencies([1]):
        with estimator.control_dependencies([tx]):
            assert _CONTROL.get() == (1, tx)
            with estimator.control_dependencies(None):
                assert _CONTROL.get() == ()
        assert _CONTROL.get() == (1,)
    assert _CONTROL.get() == ()
