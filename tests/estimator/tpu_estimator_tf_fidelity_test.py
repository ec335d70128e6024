"""TF fidelity (issue 15): each TF idiom of real TPUEstimator programs, written as TF wrote it.

One module-scoped run (8 replicas, 4 steps, checkpoints at 2 and 4) is shared by most tests;
the model_fn below is written the way the Cloud TPU reference models and BERT write theirs:
a plain ``mean()`` loss (no padding mask), ``params["use_tpu"]`` choosing
``CrossShardOptimizer``, and a ResNet-style ``tf.contrib.summary`` host_call.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tensorboard.backend.event_processing import event_accumulator as ea

import estimator
from estimator import summary
from estimator import tpu as tpu_module
from tests import helpers as h

N_TRAIN, N_EVAL, BATCH, STEPS = 64, 101, 16, 4
HOST_FN_CALLS: list = []
INPUT_CONTEXTS: list = []
USE_TPU_SEEN: list = []


def _data(n=N_TRAIN, seed=0):
    return h.make_data(n=n, d=6, classes=3, seed=seed)


def host_call_fn(gs, loss, lr):
    """ResNet's host_call, verbatim in form (tf.contrib.summary -> estimator.summary)."""
    gs = gs[0]
    with summary.create_file_writer(HOST_CALL_DIR[0], max_queue=2).as_default():
        with summary.always_record_summaries():
            summary.scalar("loss", loss[0], step=gs)
            summary.scalar("learning_rate", lr[0], step=gs)
            summary.scalar("step_times_ten", gs * 10, step=gs)
        with summary.record_summaries_every_n_global_steps(2, gs):
            summary.scalar("every_second_step", gs, step=gs)
        return summary.all_summary_ops()


HOST_CALL_DIR: list = [None]


def model_fn(features, labels, mode, params):
    """A two-layer MLP written as a TF program writes its model_fn."""
    USE_TPU_SEEN.append(params["use_tpu"])
    if params.get("init_checkpoint") and mode == estimator.ModeKeys.TRAIN:
        # BERT's non-TPU path: called directly, no scaffold.
        estimator.init_from_checkpoint(params["init_checkpoint"], {"/": "/"})
    hidden = nn.relu(nn.Dense(8, name="hidden")(features))
    logits = nn.Dense(3, name="out")(hidden)
    if mode == estimator.ModeKeys.PREDICT:
        if params.get("host_fn") is not None:
            params["host_fn"](features)
        probs = jax.nn.softmax(logits)
        return estimator.TPUEstimatorSpec(
            mode,
            predictions={"probabilities": probs, "class_ids": jnp.argmax(logits, -1)},
            export_outputs={"serving_default": estimator.PredictOutput({"probabilities": probs})},
        )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()  # no mask
    if mode == estimator.ModeKeys.TRAIN:
        lr = params.get("lr", 0.1)
        optimizer = optax.sgd(lr)
        if params["use_tpu"]:
            optimizer = estimator.CrossShardOptimizer(optimizer)
        gs_t = jnp.reshape(estimator.get_global_step(), [1])
        host_call = (
            host_call_fn,
            [gs_t, jnp.reshape(loss, [1]), jnp.full([1], lr, jnp.float32)],
        )
        return estimator.TPUEstimatorSpec(
            mode, loss=loss, train_op=optimizer, host_call=host_call if params["use_tpu"] else None
        )
    return estimator.TPUEstimatorSpec(mode, loss=loss, eval_metrics=(h.metric_fn, [labels, logits]))


def train_input_fn(params):
    INPUT_CONTEXTS.append(params["context"])
    x, y = _data()
    b = params["batch_size"]
    while True:
        for i in range(0, len(x) - b + 1, b):
            yield x[i : i + b], y[i : i + b]


def eval_input_fn(params):
    x, y = _data(N_EVAL, seed=1)
    b = params["batch_size"]
    for i in range(0, len(x), b):
        yield x[i : i + b], y[i : i + b]


def _make(model_dir, *, use_tpu=True, ipl=2, params=None, **kw):
    config = estimator.RunConfig(
        model_dir=str(model_dir),
        save_checkpoints_steps=2,
        save_summary_steps=0,
        log_step_count_steps=0,
        tpu_config=estimator.TPUConfig(iterations_per_loop=ipl),
    )
    return estimator.TPUEstimator(
        model_fn=model_fn,
        config=config,
        params=params,
        use_tpu=use_tpu,
        train_batch_size=BATCH,
        eval_batch_size=BATCH,
        predict_batch_size=BATCH,
        **kw,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """8 replicas, 4 steps, checkpoints at steps 2 and 4 (the shared trained model)."""
    model_dir = tmp_path_factory.mktemp("fidelity")
    HOST_CALL_DIR[0] = str(model_dir / "host_call")
    INPUT_CONTEXTS.clear()
    USE_TPU_SEEN.clear()
    est = _make(model_dir)
    est.train(train_input_fn, max_steps=STEPS)
    return est


def _numpy_loss(est, x, y):
    v = {n: np.asarray(est.get_variable_value(n), np.float64) for n in est.get_variable_names()}
    hidden = np.maximum(x @ v["hidden/kernel"] + v["hidden/bias"], 0)
    logits = hidden @ v["out/kernel"] + v["out/bias"]
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean()), logits


# ---------------------------------------------------------------- the estimator module


def test_tpu_module_inside_a_function_like_tf_programs(tmp_path):
    """``estimator = tpu.TPUEstimator(...)`` inside a function: no UnboundLocalError."""
    assert tpu_module.TPUEstimator is estimator.TPUEstimator
    assert tpu_module.TPUEstimatorSpec is estimator.TPUEstimatorSpec
    assert tpu_module.TPUConfig is estimator.TPUConfig
    assert tpu_module.RunConfig is estimator.RunConfig
    assert tpu_module.InputPipelineConfig is estimator.InputPipelineConfig

    def main():
        from estimator import tpu

        run_config = tpu.RunConfig(
            model_dir=str(tmp_path), tpu_config=tpu.TPUConfig(iterations_per_loop=2)
        )
        estimator = tpu.TPUEstimator(  # noqa: F841 - the TF programs' local name
            model_fn=model_fn, config=run_config, use_tpu=True, train_batch_size=BATCH
        )
        return estimator

    assert isinstance(main(), tpu_module.TPUEstimator)


def test_params_use_tpu_and_input_fn_context(run, tmp_path):
    assert set(USE_TPU_SEEN) == {True}
    ctx = INPUT_CONTEXTS[0]
    assert ctx.num_replicas == 8 and ctx.num_hosts == 1 and ctx.current_host == 0
    host, index, count, replicas = ctx.current_input_fn_deployment()
    assert (index, count, replicas) == (0, 1, 8) and "CPU" in host
    assert ctx.num_of_replicas_per_host == 8
    USE_TPU_SEEN.clear()
    INPUT_CONTEXTS.clear()
    one = _make(tmp_path, use_tpu=False)
    one.train(train_input_fn, max_steps=1)
    assert set(USE_TPU_SEEN) == {False}
    assert INPUT_CONTEXTS[0].num_replicas == 1


# ---------------------------------------------------------------- init_from_checkpoint


def test_init_from_checkpoint_called_directly_in_model_fn(run, tmp_path, caplog):
    """BERT's non-TPU path: ``init_from_checkpoint`` in model_fn restores on a fresh start."""
    source = {n: run.get_variable_value(n) for n in run.get_variable_names()}
    est = _make(tmp_path, use_tpu=False, params={"init_checkpoint": run.model_dir, "lr": 0.0})
    with caplog.at_level(logging.INFO, logger="estimator"):
        est.train(train_input_fn, max_steps=1)
    assert "restored 4 variables" in caplog.text
    for name in ("hidden/kernel", "hidden/bias", "out/kernel", "out/bias"):
        np.testing.assert_array_equal(est.get_variable_value(name), source[name], err_msg=name)


# ---------------------------------------------------------------- eval loss without a mask


@pytest.mark.parametrize("use_tpu", [True, False])
def test_eval_loss_is_the_mean_over_exactly_the_real_examples(run, use_tpu):
    """loss = per_example.mean() (no padding_mask), 101 examples, batch 16: the numpy mean."""
    est = run if use_tpu else _make(run.model_dir, use_tpu=False)
    x, y = _data(N_EVAL, seed=1)
    expected, logits = _numpy_loss(est, x, y)
    results = est.evaluate(eval_input_fn)
    assert results["loss"] == pytest.approx(expected, rel=1e-5)
    assert results["accuracy"] == pytest.approx(float((logits.argmax(-1) == y).mean()))
    assert results["global_step"] == STEPS


# ---------------------------------------------------------------- summaries in host_call


def test_contrib_summary_host_call_writes_scalars(run):
    acc = ea.EventAccumulator(HOST_CALL_DIR[0], size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "learning_rate", "step_times_ten", "every_second_step"} <= tags
    # gs is the global step model_fn read: 0..3 for the four steps.
    ten = acc.Scalars("step_times_ten")
    assert [(e.step, e.value) for e in ten] == [(s, 10.0 * s) for s in range(STEPS)]
    assert [e.step for e in acc.Scalars("every_second_step")] == [0, 2]
    assert all(e.value == pytest.approx(0.1) for e in acc.Scalars("learning_rate"))
    assert all(np.isfinite(e.value) for e in acc.Scalars("loss"))


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_path_names_the_step_like_tf(run):
    ckpt = run.latest_checkpoint()
    assert os.path.basename(ckpt) == f"model.ckpt-{STEPS}"
    assert os.path.dirname(ckpt) == os.path.abspath(run.model_dir)
    assert int(ckpt.split("-")[-1]) == STEPS  # the TF idiom
    earlier = os.path.join(run.model_dir, "model.ckpt-2")
    first = run.evaluate(eval_input_fn, checkpoint_path=earlier)
    assert first["global_step"] == 2
    assert estimator.load_variable(earlier, "out/bias").shape == (3,)


def test_list_and_load_variable(run):
    listed = estimator.list_variables(run.model_dir)
    assert listed == sorted(listed)
    shapes = dict(listed)
    assert shapes["hidden/kernel"] == [6, 8] and shapes["out/bias"] == [3]
    assert shapes["global_step"] == []
    for name in ("hidden/kernel", "out/bias"):
        np.testing.assert_array_equal(
            estimator.load_variable(run.model_dir, name), run.get_variable_value(name)
        )
    assert estimator.load_variable(run.latest_checkpoint(), "global_step") == STEPS
    np.testing.assert_array_equal(  # TF's ":0" suffix is accepted
        estimator.load_variable(run.model_dir, "out/kernel:0"), run.get_variable_value("out/kernel")
    )
    with pytest.raises(ValueError, match="out/kernl.*out/kernel"):
        estimator.load_variable(run.model_dir, "out/kernl")


def _copy_step(src_dir, step, dst_dir):
    """Copies one checkpoint into ``dst_dir`` the way a writer publishes it: whole, by rename."""
    tmp = os.path.join(dst_dir, f"model.ckpt-{step}.orbax-checkpoint-tmp-1")
    shutil.copytree(os.path.join(src_dir, f"model.ckpt-{step}"), tmp)
    os.rename(tmp, os.path.join(dst_dir, f"model.ckpt-{step}"))


def test_checkpoints_iterator_drives_a_continuous_evaluator(run, tmp_path):
    """``for ckpt in checkpoints_iterator(dir, timeout=...)``: each new checkpoint once."""
    watched = str(tmp_path)
    _copy_step(run.model_dir, 2, watched)
    # The next checkpoint arrives while the iterator waits, after it yielded the first one
    # (not on a timer: a loaded machine would start the iterator after it came).
    writer = threading.Thread(target=_copy_step, args=(run.model_dir, 4, watched))
    seen, steps = [], []
    for ckpt in estimator.checkpoints_iterator(watched, timeout=60):
        seen.append(ckpt)
        steps.append(run.evaluate(eval_input_fn, checkpoint_path=ckpt)["global_step"])
        if int(ckpt.split("-")[-1]) >= STEPS:
            break
        writer.start()
    writer.join()
    assert [os.path.basename(c) for c in seen] == ["model.ckpt-2", "model.ckpt-4"]
    assert steps == [2, 4]
    # Nothing new: it gives up after `timeout` seconds; timeout_fn decides whether to stop.
    start = time.monotonic()
    assert list(estimator.checkpoints_iterator(watched, timeout=0.2)) == [seen[-1]]
    assert time.monotonic() - start < 5
    asked = []

    def timeout_fn():
        asked.append(1)
        return len(asked) >= 2  # True: no more checkpoints will come

    got = list(estimator.checkpoints_iterator(watched, timeout=0.1, timeout_fn=timeout_fn))
    assert got == [seen[-1]] and len(asked) == 2


def test_old_checkpoint_directories_still_read(run, tmp_path):
    """A model_dir written before the rename (``checkpoints/<step>``) still reads."""
    legacy = tmp_path / "old"
    (legacy / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        os.path.join(run.model_dir, f"model.ckpt-{STEPS}"), legacy / "checkpoints" / str(STEPS)
    )
    old = _make(legacy)
    assert old.latest_checkpoint() == str(legacy / "checkpoints" / str(STEPS))
    np.testing.assert_array_equal(
        old.get_variable_value("out/kernel"), run.get_variable_value("out/kernel")
    )
    assert dict(estimator.list_variables(str(legacy)))["out/bias"] == [3]
    result = run.evaluate(eval_input_fn, checkpoint_path=str(legacy / "checkpoints" / str(STEPS)))
    assert result["global_step"] == STEPS


# ---------------------------------------------------------------- optimizers and names


def test_cross_shard_optimizer_changes_nothing(run, tmp_path):
    """8 replicas with CrossShardOptimizer == one device on the global batch without it."""
    one = _make(tmp_path, use_tpu=False)
    one.train(train_input_fn, max_steps=STEPS)
    h.assert_params_close(h.params_of(run), h.params_of(one), rtol=2e-5, atol=2e-6)
    tx = optax.adam(0.1)
    wrapped = estimator.CrossShardOptimizer(tx)
    assert "update its state" not in (estimator.CrossShardOptimizer.__doc__ or "")
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.arange(3.0)}
    a = tx.update(grads, tx.init(params), params)[0]
    b = wrapped.update(grads, wrapped.init(params), params)[0]
    np.testing.assert_array_equal(a["w"], b["w"])


def test_cross_shard_optimizer_sum_reduction_sums_over_replicas():
    """TF's ``reduction=SUM`` gave the sum of the replicas' gradients: R times the mean."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = estimator.CrossShardOptimizer(optax.sgd(1.0), reduction="sum")
    g = jnp.ones((8, 2))

    def step(g):
        return tx.update(g, tx.init(g), g)[0]

    out = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=jax.sharding.PartitionSpec("data"),
        out_specs=jax.sharding.PartitionSpec("data"),
    )(g)
    np.testing.assert_array_equal(out, -8.0 * np.ones((8, 2)))
    with pytest.raises(ValueError, match="group_assignment"):
        estimator.CrossShardOptimizer(optax.sgd(1.0), group_assignment=[[0, 1]])
    with pytest.raises(ValueError, match="MEAN or SUM"):
        estimator.CrossShardOptimizer(optax.sgd(1.0), reduction="none")


def _bert_params():
    def leaf(*shape):
        return jnp.ones(shape)

    layer = {
        "attention": {"self": {"query": {"kernel": leaf(4, 4), "bias": leaf(4)}}},
        "LayerNorm": {"scale": leaf(4), "bias": leaf(4)},
    }
    return {"bert": {"encoder": {"layer_0": layer, "layer_1": layer}}, "cls": {"b": leaf(2)}}


def test_weight_decay_mask_by_tf_variable_name():
    """BERT's ``exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"]``."""
    params = _bert_params()
    exclude = ["LayerNorm", "layer_norm", "bias"]

    def bert_do_use_weight_decay(param_name):  # BERT's optimization.py rule
        return not any(re.search(r, param_name) is not None for r in exclude)

    mask = estimator.name_mask(exclude=exclude)(params)
    names = estimator.named_variables(params)
    flat_mask = estimator.named_variables(mask)
    assert "bert/encoder/layer_0/attention/self/query/kernel" in names
    assert flat_mask == {n: bert_do_use_weight_decay(n) for n in names}
    tx = optax.adamw(1.0, weight_decay=0.5, mask=estimator.name_mask(exclude=exclude))
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    changed = {n: bool(np.any(u != 0)) for n, u in estimator.named_variables(updates).items()}
    assert changed == flat_mask == {n: bert_do_use_weight_decay(n) for n in names}
    frozen = estimator.name_mask([r"^bert/encoder/layer_0/"])(params)
    assert sum(estimator.named_variables(frozen).values()) == 4


# ---------------------------------------------------------------- configuration


def test_tf_run_config_and_resolver_arguments_are_accepted(caplog):
    with caplog.at_level(logging.WARNING, logger="estimator"):
        resolver = estimator.TPUClusterResolver(None, zone="us-central1-b", project="my-proj")
        config = estimator.RunConfig(
            master="grpc://10.0.0.2:8470",
            evaluation_master="grpc://10.0.0.2:8470",
            session_config={"allow_soft_placement": True},
            cluster=resolver,
        )
        config.replace(keep_checkpoint_max=2)  # the estimator copies configs: no new warning
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    ignored = [w for w in warnings if "ignored" in w]
    assert len(ignored) == 2, warnings
    assert "zone" in ignored[0] and "project" in ignored[0]
    assert all(n in ignored[1] for n in ("master", "evaluation_master", "session_config"))
    assert config.master == "grpc://10.0.0.2:8470"


# ---------------------------------------------------------------- export


def test_predict_output_in_export_outputs_and_export_savedmodel(run, tmp_path):
    x, _ = _data(5, seed=3)
    expected = [p["probabilities"] for p in run.predict(lambda params: iter([x]))]
    serving = estimator.build_raw_serving_input_receiver_fn(np.zeros((1, 6), np.float32))
    path = run.export_savedmodel(str(tmp_path), serving)  # ResNet's (deprecated) spelling
    served = estimator.load_saved_model(path)
    out = served(x)
    assert set(out) == {"probabilities"}
    np.testing.assert_allclose(out["probabilities"], np.stack(expected), rtol=1e-5, atol=1e-6)
    cls = estimator.ClassificationOutput(scores=np.zeros((2, 3)), classes=np.zeros((2,), int))
    assert sorted(cls.outputs) == ["classes", "scores"]
    assert list(estimator.RegressionOutput(np.zeros((2,))).outputs) == ["outputs"]
    assert list(estimator.PredictOutput(np.zeros((2,))).outputs) == ["output"]
    with pytest.raises(ValueError, match="scores or classes"):
        estimator.ClassificationOutput()


# ---------------------------------------------------------------- inputs


def test_transposed_features_error_names_the_features_entry(tmp_path):
    """ResNet's transpose_input puts the batch last: the error must blame the images."""

    def transposed_input_fn(params):
        b = params["batch_size"]
        images = np.zeros((b, 4, 4, 3), np.float32)
        yield {"image": np.transpose(images, [1, 2, 3, 0])}, np.zeros((b,), np.int32)

    est = estimator.TPUEstimator(
        model_fn=model_fn, config=h.config(tmp_path), train_batch_size=BATCH
    )
    with pytest.raises(ValueError) as info:
        est.train(transposed_input_fn, max_steps=1)
    message = str(info.value)
    assert "[0]['image']" in message and "(4, 4, 3, 16)" in message
    assert "batch" in message and "[1]" not in message.split("has")[0]


def test_tpu_strategy_reference_dataset_methods():
    strategy = estimator.TPUStrategy()
    r = strategy.num_replicas_in_sync
    x = np.arange(4 * r * 3, dtype=np.float32).reshape(4 * r, 3)
    y = np.arange(4 * r, dtype=np.int32)
    dataset = strategy.experimental_make_numpy_dataset((x, y)).batch(2 * r)
    batches = list(strategy.experimental_distribute_dataset(dataset))
    assert len(batches) == 2
    features, labels = batches[1]
    np.testing.assert_array_equal(np.concatenate(features.values), x[2 * r :])
    total = strategy.reduce("sum", strategy.run(lambda a: a.sum(), args=(features,)), axis=None)
    assert float(total) == pytest.approx(float(x[2 * r :].sum()))

    def dataset_fn(ctx):
        b = ctx.get_per_replica_batch_size(2 * r)
        return [np.full((b, 1), i, np.float32) for i in range(r)]

    steps = list(strategy.experimental_distribute_datasets_from_function(dataset_fn))
    assert len(steps) == 1 and steps[0].stacked.shape == (r, 2, 1)


# ---------------------------------------------------------------- outside_compilation


@pytest.mark.parametrize("declared", [True, False])
def test_outside_compilation_in_predict_runs_once_per_replica_per_real_step(run, declared):
    """8 replicas x 7 real steps at the default iterations_per_loop: 56 calls on real rows."""
    rows = []

    def log_rows(features):
        rows.append(np.asarray(features))

    def host_fn(features):
        if declared:
            estimator.outside_compilation(log_rows, features, result_shape=None)
        else:  # TF's form: the result shape is found by a dry run on zeros
            estimator.outside_compilation(log_rows, features)

    est = _make(run.model_dir, ipl=2, params={"host_fn": host_fn})
    x, _ = _data(7 * BATCH, seed=4)
    preds = list(est.predict(lambda params: (x[i : i + BATCH] for i in range(0, len(x), BATCH))))
    assert len(preds) == len(x)
    real = [r for r in rows if np.any(r != 0)]
    assert len(real) == 8 * 7  # never on the padded step of the last loop
    seen = np.concatenate(real)
    np.testing.assert_array_equal(np.sort(seen, axis=0), np.sort(x, axis=0))
    # The dry run (undeclared shape) happens once per function and shape, not per trace.
    assert len(rows) == 8 * 7 + (0 if declared else 1)
