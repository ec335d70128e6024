"""scaffold_fn, init_from_checkpoint and warm_start_from: fresh starts only, every collection."""

import logging
import types

import numpy as np
import pytest

import estimator
from estimator.weights.scaffold import _source_name, flatten
from tests import helpers as h

BATCH = 16


def _with_scaffold(scaffold_fn, *, estimator_spec=False):
    """helpers.model_fn, with ``scaffold_fn(spec_tensors)`` attached in TRAIN."""

    def model_fn(features, labels, mode, params):
        spec = h.model_fn(features, labels, mode, params)
        if mode != estimator.ModeKeys.TRAIN:
            return spec
        spec = estimator.TPUEstimatorSpec(
            mode,
            loss=spec.loss,
            train_op=spec.train_op,
            eval_metrics=spec.eval_metrics,
            scaffold_fn=scaffold_fn(spec),
        )
        return spec.as_estimator_spec() if estimator_spec else spec

    return model_fn


def _spy(seen):
    """A scaffold whose init_fn records the variables it is given (after any warm start)."""

    def scaffold_fn(_spec):
        def scaffold():
            def init_fn(variables):
                seen.append(flatten(variables))
                return variables

            return estimator.Scaffold(init_fn=init_fn)

        return scaffold

    return scaffold_fn


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A trained model with BatchNorm: its checkpoint is what warm starts read."""
    model_dir = tmp_path_factory.mktemp("source")
    x, y = h.make_data()
    est = h.make_estimator(model_dir, h.model_fn, params={"batch_norm": True}, ipl=2)
    est.train(h.train_input_fn(x, y), max_steps=6)
    values = h.params_of(est)
    values.pop("global_step")
    assert np.abs(values["batch_stats/BatchNorm_0/mean"]).max() > 0.01  # stats moved
    return model_dir, values


@pytest.mark.parametrize("estimator_spec", [False, True], ids=["tpu-spec", "as_estimator_spec"])
def test_scaffold_runs_only_on_a_fresh_start(tmp_path, estimator_spec):
    calls = []
    bias = np.array([1.0, 2.0, 3.0], np.float32)

    def scaffold_fn(_spec):
        def scaffold():
            calls.append(1)

            def init_fn(variables):
                variables["params"]["out"]["bias"] = bias
                return variables

            return estimator.Scaffold(init_fn=init_fn)

        return scaffold

    x, y = h.make_data()
    model_fn = _with_scaffold(scaffold_fn, estimator_spec=estimator_spec)
    # lr 0: what init_fn set is what the checkpoint holds
    est = h.make_estimator(
        tmp_path, model_fn, use_tpu=not estimator_spec, params={"lr": 0.0}, ipl=2
    )
    est.train(h.train_input_fn(x, y), steps=2)
    assert len(calls) == 1
    np.testing.assert_array_equal(est.get_variable_value("out/bias"), bias)
    est.train(h.train_input_fn(x, y), steps=2)  # resumes: the same estimator
    h.make_estimator(
        tmp_path, model_fn, use_tpu=not estimator_spec, params={"lr": 0.0}, ipl=2
    ).train(h.train_input_fn(x, y), steps=2)  # resumes: a new estimator on the same model_dir
    assert len(calls) == 1
    assert est.get_variable_value("global_step") == 6


def test_warm_start_restores_params_and_batch_statistics(tmp_path, source, caplog):
    source_dir, expected = source
    x, y = h.make_data(seed=1)
    seen = []
    est = h.make_estimator(
        tmp_path,
        _with_scaffold(_spy(seen)),
        params={"batch_norm": True, "lr": 0.0},
        warm_start_from=str(source_dir),
        ipl=2,
    )
    with caplog.at_level(logging.INFO, logger="estimator"):
        est.train(h.train_input_fn(x, y), max_steps=1)
    # what the model starts from: every variable of the source, batch statistics included
    assert sorted(seen[0]) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(seen[0][name], value, err_msg=name)
    assert "restored 8 variables" in caplog.text
    assert "not restored" not in caplog.text

    # after one step at lr 0, params are unchanged and the running statistics moved from
    # the source's by momentum 0.9 towards the first batch's (numpy reference)
    after = h.params_of(est)
    for name in ("hidden/kernel", "hidden/bias", "out/kernel", "BatchNorm_0/scale"):
        np.testing.assert_array_equal(after[name], expected[name], err_msg=name)
    hidden = x[:BATCH] @ expected["hidden/kernel"] + expected["hidden/bias"]
    mean, var = hidden.mean(0), hidden.var(0)
    np.testing.assert_allclose(
        after["batch_stats/BatchNorm_0/mean"],
        0.9 * expected["batch_stats/BatchNorm_0/mean"] + 0.1 * mean,
        rtol=1e-4,
        atol=1e-5,
    )
    np.testing.assert_allclose(
        after["batch_stats/BatchNorm_0/var"],
        0.9 * expected["batch_stats/BatchNorm_0/var"] + 0.1 * var,
        rtol=1e-4,
        atol=1e-5,
    )


def test_warm_start_settings_regex_selects_variables_and_logs_the_rest(tmp_path, source, caplog):
    source_dir, expected = source
    seen = []
    settings = estimator.WarmStartSettings(str(source_dir), vars_to_warm_start=r"(hidden|out)/")
    est = h.make_estimator(
        tmp_path,
        _with_scaffold(_spy(seen)),
        params={"batch_norm": True},
        warm_start_from=settings,
        ipl=2,
    )
    x, y = h.make_data()
    with caplog.at_level(logging.INFO, logger="estimator"):
        est.train(h.train_input_fn(x, y), max_steps=1)
    got = seen[0]
    for name in ("hidden/kernel", "hidden/bias", "out/kernel", "out/bias"):
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    # not selected: fresh BatchNorm initial values
    np.testing.assert_array_equal(got["batch_stats/BatchNorm_0/mean"], np.zeros(16))
    np.testing.assert_array_equal(got["batch_stats/BatchNorm_0/var"], np.ones(16))
    assert "restored 4 variables" in caplog.text
    assert "4 variables not restored" in caplog.text
    assert "batch_stats/BatchNorm_0/mean" in caplog.text.split("not restored")[1]


def test_init_from_checkpoint_with_an_assignment_map(tmp_path, source):
    source_dir, expected = source
    path = str(source_dir / "model.ckpt-6")
    seen = []

    def scaffold_fn(_spec):
        restore = estimator.init_from_checkpoint(path, {"hidden/": "hidden/"})

        def scaffold():
            def init_fn(variables):
                variables = restore(variables)
                seen.append(flatten(variables))
                return variables

            return estimator.Scaffold(init_fn=init_fn)

        return scaffold

    est = h.make_estimator(
        tmp_path, _with_scaffold(scaffold_fn), params={"batch_norm": True}, ipl=2
    )
    x, y = h.make_data()
    est.train(h.train_input_fn(x, y), max_steps=1)
    np.testing.assert_array_equal(seen[0]["hidden/kernel"], expected["hidden/kernel"])
    assert not np.array_equal(seen[0]["out/kernel"], expected["out/kernel"])


def test_init_from_checkpoint_shape_mismatch_names_the_variable(tmp_path, source):
    source_dir, _ = source
    restore = estimator.init_from_checkpoint(str(source_dir), {"hidden/": "hidden/"})
    model_fn = _with_scaffold(lambda _spec: lambda: estimator.Scaffold(init_fn=restore))
    est = h.make_estimator(tmp_path, model_fn, params={"batch_norm": True, "hidden": 8}, ipl=2)
    x, y = h.make_data()
    shapes = r"variable 'hidden/\w+' has shape \(.*8,?\) but checkpoint .* has shape \(.*16,?\)"
    with pytest.raises(ValueError, match=shapes):
        est.train(h.train_input_fn(x, y), max_steps=1)


@pytest.mark.parametrize(
    "mapping, name, expected",
    [
        ({"/": "/"}, "out/kernel", "out/kernel"),
        ({"old/": "new/"}, "new/dense/kernel", "old/dense/kernel"),
        ({"/": "encoder/"}, "encoder/dense/kernel", "dense/kernel"),
        ({"a/b": "c/d"}, "c/d", "a/b"),
        ({"/": "/", "pre/": "enc/"}, "enc/k", "pre/k"),  # the longest scope wins
        ({"old/": "new/"}, "other/kernel", None),
    ],
)
def test_assignment_map_names(mapping, name, expected):
    assert _source_name(name, mapping) == expected


def test_scaffold_fn_capturing_a_traced_value_is_a_clear_error(tmp_path):
    def scaffold_fn(spec):
        loss = spec.loss  # a traced value of the compiled model_fn

        def scaffold():
            return estimator.Scaffold(init_fn=lambda v: v if float(loss) > 0 else v)

        return scaffold

    est = h.make_estimator(tmp_path, _with_scaffold(scaffold_fn), ipl=2)
    x, y = h.make_data()
    with pytest.raises(estimator.TracedValueError, match=r"scaffold_fn captures 'loss'"):
        est.train(h.train_input_fn(x, y), max_steps=1)


def test_init_fn_capturing_a_traced_value_is_a_clear_error(tmp_path):
    def scaffold_fn(spec):
        box = types.SimpleNamespace(loss=spec.loss)  # hidden from scaffold_fn's own check

        def scaffold():
            return estimator.Scaffold(init_fn=lambda v, loss=box.loss: {**v, "params": loss})

        return scaffold

    est = h.make_estimator(tmp_path, _with_scaffold(scaffold_fn), ipl=2)
    x, y = h.make_data()
    with pytest.raises(estimator.TracedValueError, match="Scaffold.init_fn captures 'loss'"):
        est.train(h.train_input_fn(x, y), max_steps=1)


def test_scaffold_fn_must_return_a_scaffold(tmp_path):
    est = h.make_estimator(tmp_path, _with_scaffold(lambda _spec: lambda: {"init_fn": None}), ipl=2)
    x, y = h.make_data()
    with pytest.raises(ValueError, match="must return an estimator.Scaffold"):
        est.train(h.train_input_fn(x, y), max_steps=1)
