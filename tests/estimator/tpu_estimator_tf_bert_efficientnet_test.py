"""TF fidelity of the BERT / EfficientNet generation (issue 27): their idioms, each
written as the TF program writes it (namespace changed only).

Items tested elsewhere: trainable_variables and get_or_create_global_step
(``trainable_test.py``), Saver / Scaffold(saver=) and checkpoints with extra variables
(``saver_test.py``), exporters (``exporters_test.py``), the ported EfficientNet main
(``tests/examples/efficientnet_tpu_test.py``).
"""

from __future__ import annotations

import collections
import logging
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
import estimator.core.errors
from estimator import summary
from hooks import event_reader
from tests import helpers as h

X, Y = h.make_data(n=64, d=6, classes=3, seed=7)


# --------------------------------------------------------------------------- 1: BERT warm start
def get_assignment_map_from_checkpoint(tvars, init_checkpoint):
    """BERT's modeling.get_assignment_map_from_checkpoint, verbatim but for the namespace."""
    initialized_variable_names = {}
    name_to_variable = collections.OrderedDict()
    for var in tvars:
        name = var.name
        m = re.match("^(.*):\\d+$", name)
        if m is not None:
            name = m.group(1)
        name_to_variable[name] = var
    init_vars = estimator.list_variables(init_checkpoint)
    assignment_map = collections.OrderedDict()
    for x in init_vars:
        (name, var) = (x[0], x[1])
        if name not in name_to_variable:
            continue
        assignment_map[name] = name
        initialized_variable_names[name] = 1
        initialized_variable_names[name + ":0"] = 1
    return (assignment_map, initialized_variable_names)


def _encoder(x):
    return nn.relu(nn.Dense(8, name="bert_hidden")(x))


def pretrain_model_fn(features, labels, mode, params):
    logits = nn.Dense(3, name="pretrain_head")(_encoder(features))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.5))


def classifier_model_fn(features, labels, mode, params):
    """run_classifier's model_fn: the encoder from init_checkpoint, a new output layer."""
    logits = nn.Dense(3, name="output_weights")(_encoder(features))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    tvars = estimator.trainable_variables()
    init_checkpoint = params["init_checkpoint"]
    scaffold_fn = None
    if init_checkpoint:
        (assignment_map, initialized_variable_names) = get_assignment_map_from_checkpoint(
            tvars, init_checkpoint
        )
        if params["tpu_scaffold"]:  # BERT: `if use_tpu:`

            def tpu_scaffold():
                estimator.init_from_checkpoint(init_checkpoint, assignment_map)
                return estimator.Scaffold()

            scaffold_fn = tpu_scaffold
        else:
            estimator.init_from_checkpoint(init_checkpoint, assignment_map)
    # lr 0: after one step the variables are exactly what the restore put there.
    return estimator.TPUEstimatorSpec(
        mode, loss=loss, train_op=optax.sgd(0.0), scaffold_fn=scaffold_fn
    )


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("pretrained")
    est = h.make_estimator(model_dir, pretrain_model_fn)
    est.train(h.train_input_fn(X, Y, features_dict=False), max_steps=2)
    return est


@pytest.mark.parametrize(
    "use_tpu, tpu_scaffold",
    [(True, True), (False, True), (False, False)],
    ids=["scaffold-8-devices", "scaffold-1-device", "model_fn-1-device"],
)
def test_bert_tpu_scaffold_restores_every_variable_exactly(
    tmp_path, pretrained, use_tpu, tpu_scaffold
):
    est = h.make_estimator(
        tmp_path,
        classifier_model_fn,
        use_tpu=use_tpu,
        params={"init_checkpoint": pretrained.model_dir, "tpu_scaffold": tpu_scaffold},
    )
    est.train(h.train_input_fn(X, Y, features_dict=False), max_steps=1)
    for name in ("bert_hidden/kernel", "bert_hidden/bias"):
        np.testing.assert_array_equal(
            est.get_variable_value(name), pretrained.get_variable_value(name), err_msg=name
        )
    assert "output_weights/kernel" in est.get_variable_names()  # new, kept its initial value


# --------------------------------------------------------------------------- 6 and 10: export
class _ResNetV1(nn.Module):
    """A module whose class name starts with ``_`` (tensorflow/tpu's ``_ResNetV1``)."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


def resnet_model_fn(features, labels, mode, params):
    logits = _ResNetV1()(features["x"])
    if mode == estimator.ModeKeys.PREDICT:
        predictions = {"classes": jnp.argmax(logits, 1), "probabilities": jax.nn.softmax(logits)}
        return estimator.TPUEstimatorSpec(
            mode,
            predictions=predictions,
            export_outputs={"classify": estimator.export.PredictOutput(predictions)},
        )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.3))


def image_serving_input_fn():
    """ResNet's serving input form: ``ServingInputReceiver(features, receiver_tensors)``."""
    images = jax.ShapeDtypeStruct((1, 6), jnp.float32)
    return estimator.export.ServingInputReceiver({"x": images}, {"x": images})


def test_underscore_module_exports_and_serves(tmp_path):
    est = h.make_estimator(tmp_path / "run", resnet_model_fn)
    est.train(h.train_input_fn(X, Y), max_steps=2)
    assert any(n.startswith("_ResNetV1_0/") for n in est.get_variable_names())
    path = est.export_saved_model(str(tmp_path / "export"), image_serving_input_fn)
    want = np.stack([p["probabilities"] for p in est.predict(h.eval_input_fn(X))])
    served = estimator.load_saved_model(path)({"x": X})
    np.testing.assert_allclose(served["probabilities"], want, rtol=1e-5, atol=1e-6)
    from estimator.io import tf_saved_model

    if tf_saved_model.tensorflow_available():  # the TF SavedModel too, through TF itself
        import tensorflow as tf

        serve = tf.saved_model.load(path).signatures["classify"]
        out = serve(x=tf.constant(X))
        np.testing.assert_allclose(out["probabilities"].numpy(), want, rtol=1e-5, atol=1e-6)


def test_export_namespace_is_tfs():
    export = estimator.export
    assert export.PredictOutput is estimator.PredictOutput
    assert export.ClassificationOutput is estimator.ClassificationOutput
    assert export.RegressionOutput is estimator.RegressionOutput
    fn = export.build_raw_serving_input_receiver_fn({"x": np.zeros((1, 6), np.float32)})
    assert fn()["x"].shape == (1, 6)
    assert callable(estimator.TPUEstimator.export_saved_model)
    import estimator.driver.export as driver_export
    import estimator.io.export as io_export

    assert callable(driver_export.export_saved_model) and callable(io_export.load_saved_model)
    assert estimator.export is not io_export


def test_serving_receiver_tensors_other_than_the_features_are_named(caplog):
    with caplog.at_level(logging.WARNING, logger="estimator"):
        estimator.export.ServingInputReceiver(
            {"x": np.zeros((1, 6), np.float32)}, {"image_bytes": np.zeros((1,), np.float32)}
        )
    assert any("receiver_tensors" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- 7: TF2 summaries
HOST_DIR: list = [None]


def host_call_fn(gs, lr):
    """EfficientNet's host_call, as written (tf2.summary -> estimator.summary)."""
    gs = gs[0]
    with summary.create_file_writer(HOST_DIR[0], max_queue=4).as_default():
        with summary.record_if(True):
            summary.scalar("learning_rate", lr[0], step=gs)
        with summary.record_if(lambda: gs % 2 == 0):
            summary.scalar("even_steps", lr[0], step=gs)
        with summary.record_if(False):
            summary.scalar("never", lr[0], step=gs)
        return summary.all_v2_summary_ops()


def efficientnet_model_fn(features, labels, mode, params):
    logits = nn.Dense(3, name="head")(features)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    global_step = estimator.get_or_create_global_step()
    lr = 0.1 * jnp.ones([1])
    gs_t = jnp.reshape(global_step, [1])
    return estimator.TPUEstimatorSpec(
        mode, loss=loss, train_op=optax.sgd(0.1), host_call=(host_call_fn, [gs_t, lr])
    )


def test_tf2_host_call_summaries(tmp_path):
    HOST_DIR[0] = str(tmp_path / "host")
    est = h.make_estimator(tmp_path / "run", efficientnet_model_fn)
    est.train(h.train_input_fn(X, Y, features_dict=False), max_steps=4)
    by_step = event_reader.read_eval_metrics(HOST_DIR[0])
    # The step model_fn computes (before its update), as TF's global_step tensor there.
    assert sorted(s for s, v in by_step.items() if "learning_rate" in v) == [0, 1, 2, 3]
    assert sorted(s for s, v in by_step.items() if "even_steps" in v) == [0, 2]
    assert not any("never" in v for v in by_step.values())


def test_record_if_refuses_what_is_not_a_condition():
    with pytest.raises(ValueError, match="record_if"):
        summary.record_if("sometimes")


# --------------------------------------------------------------------------- 8: TF-only arguments
def test_tf_only_arguments_are_accepted_with_one_warning_each(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="estimator"):
        tpu = estimator.TPUConfig(
            iterations_per_loop=2,
            tpu_job_name="tpu_worker",
            initial_infeed_sleep_secs=5,
            experimental_host_call_every_n_steps=3,
        )
        est = estimator.TPUEstimator(
            h.model_fn,
            config=estimator.RunConfig(model_dir=str(tmp_path), tpu_config=tpu),
            train_batch_size=16,
            eval_on_tpu=False,
            export_to_tpu=False,
            export_to_cpu=True,
            batch_axis=(0, 0),
        )
        tpu.replace(iterations_per_loop=4)  # a copy: no second warning
    messages = [r.getMessage() for r in caplog.records]
    tpu_notes = [m for m in messages if m.startswith("TPUConfig:")]
    assert len(tpu_notes) == 1
    assert "tpu_job_name" in tpu_notes[0] and "initial_infeed_sleep_secs" in tpu_notes[0]
    for name in ("eval_on_tpu", "export_to_tpu", "export_to_cpu", "batch_axis"):
        assert sum(f"TPUEstimator({name}=" in m for m in messages) == 1, name
    assert est.config.tpu_config.host_call_every_n_steps == 3


def test_tf_only_arguments_that_would_change_results_are_refused(tmp_path):
    with pytest.raises(ValueError, match="flax.linen.Embed"):
        estimator.TPUEstimator(h.model_fn, model_dir=str(tmp_path), embedding_config_spec=object())
    with pytest.raises(ValueError, match="first dimension"):
        estimator.TPUEstimator(h.model_fn, model_dir=str(tmp_path), batch_axis=(3, 0))


# --------------------------------------------------------------------------- 9: NoCheckpointError
def test_missing_checkpoint_path_is_tfs_not_found(tmp_path, pretrained):
    """``except tf.errors.NotFoundError`` ports as ``except estimator.NoCheckpointError``."""
    est = h.make_estimator(tmp_path, pretrain_model_fn)
    missing = [
        f"{pretrained.model_dir}/model.ckpt-99",  # a step that is not there
        str(tmp_path / "nowhere"),  # not a checkpoint at all
    ]
    for path in missing:
        try:
            est.evaluate(h.eval_input_fn(X, Y), checkpoint_path=path)
        except estimator.NoCheckpointError as e:
            assert isinstance(e, ValueError)  # what old except clauses caught
            assert isinstance(e, estimator.core.errors.EstimatorValueError)
        else:
            pytest.fail(f"no NoCheckpointError for {path}")


# --------------------------------------------------------------------------- 11: 2-sequences
def test_a_two_element_list_is_features_and_labels(tmp_path):
    """A PyTorch DataLoader yields ``[x, y]`` lists: the same training as ``(x, y)`` tuples."""

    def list_input_fn(params):
        b = params["batch_size"]
        while True:
            for i in range(0, len(X) - b + 1, b):
                yield [X[i : i + b], Y[i : i + b]]

    as_lists = h.make_estimator(tmp_path / "lists")
    as_lists.train(list_input_fn, max_steps=3)
    as_tuples = h.make_estimator(tmp_path / "tuples")
    as_tuples.train(h.train_input_fn(X, Y), max_steps=3)  # dict features, tuple batches
    h.assert_params_close(h.params_of(as_lists), h.params_of(as_tuples), rtol=1e-6)


def test_other_sequence_lengths_are_a_clear_error(tmp_path):
    def three(params):
        yield X[:16], Y[:16], Y[:16]

    with pytest.raises(ValueError, match="only a 2-tuple is read as"):
        h.make_estimator(tmp_path).train(three, max_steps=1)
