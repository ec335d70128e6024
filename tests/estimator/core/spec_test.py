"""TPUEstimatorSpec / RunConfig / TPUConfig / constructor validation: each error names its field."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
import hooks
from estimator import ModeKeys, TPUEstimatorSpec

LOSS = jnp.float32(1.0)
TX = optax.sgd(0.1)
T = jnp.ones((4, 2))


def _fn1(a):
    return {}


def _fn2(a, b):
    return {}


SPEC_ERRORS = [
    ("missing loss in train", dict(mode=ModeKeys.TRAIN, train_op=TX), ValueError, "loss"),
    ("missing loss in eval", dict(mode=ModeKeys.EVAL), ValueError, "loss"),
    ("missing train_op", dict(mode=ModeKeys.TRAIN, loss=LOSS), ValueError, "train_op"),
    (
        "train_op not optax",
        dict(mode=ModeKeys.TRAIN, loss=LOSS, train_op="sgd"),
        TypeError,
        "train_op",
    ),
    ("missing predictions", dict(mode=ModeKeys.PREDICT), ValueError, "predictions"),
    ("loss not scalar", dict(mode=ModeKeys.EVAL, loss=jnp.ones(3)), ValueError, "loss"),
    ("bad mode", dict(mode="training", loss=LOSS), ValueError, "mode"),
    (
        "eval_metrics not a pair",
        dict(mode=ModeKeys.EVAL, loss=LOSS, eval_metrics=(_fn1,)),
        ValueError,
        "eval_metrics",
    ),
    (
        "eval_metrics fn not callable",
        dict(mode=ModeKeys.EVAL, loss=LOSS, eval_metrics=("acc", [T])),
        TypeError,
        "eval_metrics",
    ),
    (
        "eval_metrics tensors not list/dict",
        dict(mode=ModeKeys.EVAL, loss=LOSS, eval_metrics=(_fn1, T)),
        TypeError,
        "eval_metrics",
    ),
    (
        "eval_metrics wrong arg count",
        dict(mode=ModeKeys.EVAL, loss=LOSS, eval_metrics=(_fn2, [T])),
        ValueError,
        "eval_metrics",
    ),
    (
        "eval_metrics rank 0",
        dict(mode=ModeKeys.EVAL, loss=LOSS, eval_metrics=(_fn1, [jnp.float32(1)])),
        ValueError,
        "rank 0",
    ),
    (
        "host_call not a pair",
        dict(mode=ModeKeys.TRAIN, loss=LOSS, train_op=TX, host_call=[_fn1, [T], 3]),
        ValueError,
        "host_call",
    ),
    (
        "host_call rank 0 dict",
        dict(
            mode=ModeKeys.TRAIN,
            loss=LOSS,
            train_op=TX,
            host_call=(lambda **k: None, {"lr": jnp.float32(1)}),
        ),
        ValueError,
        "'lr'",
    ),
    (
        "host_call wrong arg count",
        dict(mode=ModeKeys.TRAIN, loss=LOSS, train_op=TX, host_call=(_fn1, [T, T])),
        ValueError,
        "host_call",
    ),
    (
        "hook of wrong type",
        dict(mode=ModeKeys.TRAIN, loss=LOSS, train_op=TX, training_hooks=["not a hook"]),
        TypeError,
        "training_hooks",
    ),
    (
        "eval hook of wrong type",
        dict(mode=ModeKeys.EVAL, loss=LOSS, evaluation_hooks=[object()]),
        TypeError,
        "evaluation_hooks",
    ),
    (
        "scaffold_fn not callable",
        dict(mode=ModeKeys.TRAIN, loss=LOSS, train_op=TX, scaffold_fn=3),
        TypeError,
        "scaffold_fn",
    ),
    (
        "export_outputs not dict",
        dict(mode=ModeKeys.PREDICT, predictions=T, export_outputs=[T]),
        TypeError,
        "export_outputs",
    ),
]


@pytest.mark.parametrize(
    "kwargs,error,match", [c[1:] for c in SPEC_ERRORS], ids=[c[0] for c in SPEC_ERRORS]
)
def test_spec_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        TPUEstimatorSpec(**kwargs)


def test_valid_specs_and_as_estimator_spec():
    spec = TPUEstimatorSpec(
        ModeKeys.TRAIN,
        loss=jnp.ones([1]),
        train_op=TX,
        host_call=(_fn1, [T]),
        training_hooks=[hooks.SessionRunHook()],
    )
    plain = spec.as_estimator_spec()
    assert isinstance(plain, estimator.EstimatorSpec)
    assert plain.to_tpu_spec() is spec
    estimator.EstimatorSpec(ModeKeys.PREDICT, predictions={"y": T})
    with pytest.raises(ValueError, match="eval_metric_ops"):
        estimator.EstimatorSpec(ModeKeys.EVAL, loss=LOSS, eval_metric_ops={"a": 1})


CONFIG_ERRORS = [
    (lambda: estimator.TPUConfig(iterations_per_loop=0), ValueError, "iterations_per_loop"),
    (lambda: estimator.TPUConfig(iterations_per_loop="2"), TypeError, "iterations_per_loop"),
    (lambda: estimator.TPUConfig(num_shards=-1), ValueError, "num_shards"),
    (
        lambda: estimator.TPUConfig(per_host_input_for_training=9),
        ValueError,
        "per_host_input_for_training",
    ),
    (
        lambda: estimator.TPUConfig(input_partition_dims=[[1, 2]]),
        ValueError,
        "num_cores_per_replica",
    ),
    (lambda: estimator.TPUConfig(host_call_every_n_steps=0), ValueError, "host_call_every_n_steps"),
    (
        lambda: estimator.RunConfig(save_checkpoints_steps=5, save_checkpoints_secs=5),
        ValueError,
        "save_checkpoints",
    ),
    (lambda: estimator.RunConfig(keep_checkpoint_max=0), ValueError, "keep_checkpoint_max"),
    (lambda: estimator.RunConfig(tf_random_seed=1.5), TypeError, "tf_random_seed"),
    # issue 42: an OverflowError deep in JAX at the first step, naming no field
    (lambda: estimator.RunConfig(tf_random_seed=2**70), ValueError, "tf_random_seed must fit"),
    (lambda: estimator.RunConfig(tf_random_seed=2**63), ValueError, "tf_random_seed must fit"),
    (lambda: estimator.RunConfig(tpu_config={"iterations_per_loop": 2}), TypeError, "tpu_config"),
    (lambda: estimator.RunConfig(model_dir=""), ValueError, "model_dir"),
]


@pytest.mark.parametrize("make,error,match", CONFIG_ERRORS)
def test_config_validation(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_run_config_replace_clears_other_cadence():
    c = estimator.RunConfig(save_checkpoints_secs=30).replace(save_checkpoints_steps=10)
    assert (c.save_checkpoints_steps, c.save_checkpoints_secs) == (10, None)
    assert estimator.RunConfig().checkpoint_every_secs == 600


def _mf(features, labels, mode, params):
    return None


def _no_params(features, labels, mode):
    return None


def _unknown(features, labels, mode, params, extra):
    return None


CTOR_ERRORS = [
    (dict(model_fn=_no_params, train_batch_size=8), ValueError, "params"),
    (dict(model_fn=_unknown, train_batch_size=8), ValueError, "extra"),
    (dict(model_fn=_mf, params={"batch_size": 3}, train_batch_size=8), ValueError, "batch_size"),
    (dict(model_fn=_mf, params={"context": 3}, train_batch_size=8), ValueError, "context"),
    (dict(model_fn=_mf), ValueError, "train_batch_size"),
    (dict(model_fn=_mf, train_batch_size=12), ValueError, "train_batch_size"),
    (dict(model_fn=_mf, train_batch_size=8, eval_batch_size=-8), ValueError, "eval_batch_size"),
    (
        dict(model_fn=_mf, train_batch_size=8, predict_batch_size=4.0),
        TypeError,
        "predict_batch_size",
    ),
    (dict(model_fn=_mf, train_batch_size=8, config="cfg"), TypeError, "config"),
    (
        dict(
            model_fn=_mf,
            train_batch_size=8,
            config=estimator.RunConfig(tpu_config=estimator.TPUConfig(num_shards=3)),
        ),
        ValueError,
        "num_shards",
    ),
]


@pytest.mark.parametrize("kwargs,error,match", CTOR_ERRORS)
def test_constructor_validation(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        estimator.TPUEstimator(model_dir=str(tmp_path), **kwargs)


def test_model_dir_must_match_config(tmp_path):
    with pytest.raises(ValueError, match="model_dir"):
        estimator.TPUEstimator(
            _mf,
            model_dir=str(tmp_path / "a"),
            train_batch_size=8,
            config=estimator.RunConfig(model_dir=str(tmp_path / "b")),
        )


def test_params_are_deep_copied(tmp_path):
    params = {"layers": [1, 2]}
    est = estimator.TPUEstimator(_mf, model_dir=str(tmp_path), params=params, train_batch_size=8)
    params["layers"].append(3)
    assert est.params["layers"] == [1, 2]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(steps=1, max_steps=2), "both"),
        (dict(steps=0), "steps"),
        (dict(max_steps=-1), "max_steps"),
    ],
)
def test_train_step_arguments(tmp_path, kwargs, match):
    est = estimator.TPUEstimator(_mf, model_dir=str(tmp_path), train_batch_size=8)
    with pytest.raises(ValueError, match=match):
        est.train(lambda params: iter([]), **kwargs)


def test_model_fn_returning_wrong_type_is_named(tmp_path):
    est = estimator.TPUEstimator(_mf, model_dir=str(tmp_path), train_batch_size=8)
    x = np.zeros((8, 2), np.float32)
    with pytest.raises(TypeError, match="TPUEstimatorSpec"):
        est.train(lambda params: iter([(x, x)]), max_steps=1)
