"""export_saved_model / load_saved_model, against predict, in a process without the model code."""

import json
import os
import subprocess
import sys
import textwrap
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
from estimator.cli import app as cli
from estimator.io.export import build_raw_serving_input_receiver_fn, load_saved_model
from estimator.parallel.outside_compilation import outside_compilation
from tests import helpers as h

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PREDICT_BATCH = 16
PREDICT = "tensorflow/serving/predict"


def _portable(path, *parts):
    """A file of our portable export, in ``assets.extra/`` of the export directory."""
    return os.path.join(path, "assets.extra", *parts)


def _trained(model_dir, model_fn=h.model_fn, *, params=None, steps=8, features_dict=True):
    x, y = h.make_data()
    est = estimator.TPUEstimator(
        model_fn,
        config=h.config(model_dir),
        params=params or {"batch_norm": True},
        train_batch_size=16,
        predict_batch_size=PREDICT_BATCH,
    )
    est.train(h.train_input_fn(x, y, features_dict=features_dict), max_steps=steps)
    return est


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The helpers' MLP with BatchNorm (so two collections), 8 replicas, 8 steps."""
    return _trained(tmp_path_factory.mktemp("model"))


def _predict_all(est, x):
    return list(est.predict(h.eval_input_fn(x, with_row=True)))


# Runs in a fresh interpreter that cannot import the model code (models, tests, configs).
_LOADER = textwrap.dedent("""
    import importlib.abc, json, sys
    import numpy as np

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("models", "tests", "configs"):
                raise ImportError(f"{name} must not be needed to serve an export")

    sys.meta_path.insert(0, Blocked())
    from estimator.io.export import load_saved_model

    paths, data, out = sys.argv[1].split(","), np.load(sys.argv[2]), sys.argv[3]
    x, rows = data["x"], data["row"]
    results = {}
    for i, path in enumerate(paths):
        model = load_saved_model(path)
        for batch in (1, 7, int(sys.argv[4])):
            parts = [model({"x": x[j:j + batch], "row": rows[j:j + batch]})
                     for j in range(0, len(x), batch)]
            for key in parts[0]:
                results[f"{i}/{batch}/{key}"] = np.concatenate([p[key] for p in parts])
    np.savez(out, **results)
    import jax
    print(json.dumps({"loaded": sorted(m for m in sys.modules
                                       if m.split(".")[0] in ("models", "tests", "configs")),
                      "devices": jax.device_count()}))
""")


def test_export_then_load_in_a_fresh_process_equals_predict(tmp_path, trained):
    est = trained
    x = h.make_data(n=37, seed=1)[0]
    expected = _predict_all(est, x)
    fn = build_raw_serving_input_receiver_fn({"x": x[:1], "row": np.zeros((1,), np.int32)})
    paths = [
        est.export_saved_model(str(tmp_path / "export"), fn, fold_variables=fold)
        for fold in (False, True)
    ]
    np.savez(tmp_path / "data.npz", x=x, row=np.arange(len(x), dtype=np.int32))
    script = tmp_path / "serve.py"
    script.write_text(_LOADER)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [
            sys.executable,
            str(script),
            ",".join(paths),
            str(tmp_path / "data.npz"),
            str(tmp_path / "out.npz"),
            str(PREDICT_BATCH),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report == {"loaded": [], "devices": 1}
    got = np.load(tmp_path / "out.npz")
    logits = np.stack([p["logits"] for p in expected])
    for i in range(2):
        for batch in (1, 7, PREDICT_BATCH):
            np.testing.assert_allclose(
                got[f"{i}/{batch}/logits"],
                logits,
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"fold={bool(i)} batch={batch}",
            )
            np.testing.assert_array_equal(got[f"{i}/{batch}/row"], np.arange(len(x)))


def test_directory_signature_and_variables(tmp_path, trained):
    est = trained
    fn = build_raw_serving_input_receiver_fn({"x": np.zeros((3, 6)), "row": np.zeros(3, np.int64)})
    before = time.time()
    beside = est.export_saved_model(str(tmp_path / "export"), fn)
    folded = est.export_saved_model(str(tmp_path / "export"), fn, fold_variables=True)
    assert beside != folded  # same second or not, every export gets its own directory
    for path in (beside, folded):
        assert os.path.dirname(path) == str(tmp_path / "export")
        assert int(os.path.basename(path)) >= int(before)
    assert sorted(os.listdir(tmp_path / "export")) == sorted(
        os.path.basename(p) for p in (beside, folded)
    )  # no temp- directory left
    sig = json.loads(open(_portable(beside, "signature.json")).read())
    assert sig["inputs"] == {
        "x": {"shape": ["b", 6], "dtype": "float32"},
        "row": {"shape": ["b"], "dtype": "int32"},
    }
    assert sig["outputs"] == {
        "logits": {"shape": ["b", 3], "dtype": "float32"},
        "row": {"shape": ["b"], "dtype": "int32"},
    }
    assert sig["global_step"] == 8 and sig["platforms"] == ["cpu"]
    assert sig["signatures"] == {
        "serving_default": {"method": PREDICT, "outputs": {"logits": "logits", "row": "row"}}
    }
    # With TensorFlow installed (the test extra), the directory is a TF SavedModel too.
    assert sig["tf_saved_model"] is True
    for path in (beside, folded):
        assert os.path.isfile(os.path.join(path, "saved_model.pb"))
    # The stored variables are exactly the checkpoint's.
    stored = np.load(_portable(beside, "variables", "variables.npz"))
    # Named as get_variable_names names them (signature version 2).
    assert sig["signature_version"] == 2
    assert sorted(v["name"] for v in sig["variables"]["list"]) == sorted(stored.files)
    names = {n: n for n in stored.files}
    assert sorted(names) == sorted(set(est.get_variable_names()) - {"global_step"})
    for name, key in names.items():
        np.testing.assert_array_equal(stored[key], est.get_variable_value(name), err_msg=name)
    sig_folded = json.loads(open(_portable(folded, "signature.json")).read())
    assert sig_folded["variables"]["stored"] == "folded"
    assert not os.path.exists(_portable(folded, "variables"))
    # Folded: the serialized program takes the two features and nothing else.
    exported = jax.export.deserialize(
        bytearray(open(_portable(folded, "saved_model.jax"), "rb").read())
    )
    assert [str(a) for a in exported.in_avals] == ["int32[b]", "float32[b,6]"]
    assert len(load_saved_model(beside).exported.in_avals) == 2 + len(stored.files)
    # A base directory loads its newest export.
    assert load_saved_model(str(tmp_path / "export")).path == folded
    batch = {"x": h.make_data(n=5)[0], "row": np.arange(5)}
    # Lowered for several platforms, it still runs here, with the same results.
    multi = est.export_saved_model(str(tmp_path / "multi"), fn, platforms=("cpu", "cuda", "tpu"))
    model = load_saved_model(multi)
    assert model.signature["platforms"] == ["cpu", "cuda", "tpu"]
    for key, value in model(batch).items():
        np.testing.assert_array_equal(value, load_saved_model(beside)(batch)[key], err_msg=key)


def test_loader_reads_version_1_signatures(tmp_path, trained):
    """Exports written before variable names were unified (``params/dense/kernel``, no
    ``signature_version``) still load and give the same outputs."""
    import shutil

    fn = build_raw_serving_input_receiver_fn({"x": np.zeros((3, 6)), "row": np.zeros(3, np.int64)})
    path = trained.export_saved_model(str(tmp_path / "export"), fn)
    old = str(tmp_path / "old")
    shutil.copytree(_portable(path), old)  # version 1 also had its files at the top
    sig_path, npz_path = (
        os.path.join(old, "signature.json"),
        os.path.join(old, "variables", "variables.npz"),
    )
    sig = json.loads(open(sig_path).read())
    del sig["signature_version"]
    stored = dict(np.load(npz_path))
    renamed = {}
    for v in sig["variables"]["list"]:
        old_name = (
            v["name"]
            if "/" in v["name"] and v["name"].split("/")[0] == "batch_stats"
            else "params/" + v["name"]
        )
        renamed[old_name] = stored[v["name"]]
        v["name"] = old_name
    np.savez(npz_path, **renamed)
    open(sig_path, "w").write(json.dumps(sig))
    x = {"x": np.arange(18, dtype=np.float32).reshape(3, 6) / 18, "row": np.arange(3)}
    new_out, old_out = load_saved_model(path)(x), load_saved_model(old)(x)
    assert sorted(new_out) == sorted(old_out)
    for key in new_out:
        np.testing.assert_array_equal(new_out[key], old_out[key])


def _export_outputs_model_fn(features, labels, mode, params):
    logits = nn.Dense(3, name="out")(features)
    if mode == estimator.ModeKeys.PREDICT:
        return estimator.TPUEstimatorSpec(
            mode,
            predictions={"logits": logits, "class_ids": logits.argmax(-1)},
            export_outputs={"probabilities": jax.nn.softmax(logits), "scores": "logits"},
        )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.1))


def test_export_outputs_choose_the_outputs_and_single_array_features(tmp_path):
    est = _trained(tmp_path / "model", _export_outputs_model_fn, params={}, features_dict=False)
    x = h.make_data(n=10, seed=2)[0]
    expected = np.stack([p["logits"] for p in est.predict(lambda params: iter([x]))])
    path = est.export_saved_model(
        str(tmp_path / "export"), lambda: jax.ShapeDtypeStruct((1, 6), jnp.float32)
    )
    model = load_saved_model(path)
    assert model.input_names == ["features"]
    assert sorted(model.output_names) == ["probabilities", "scores"]
    # Plain arrays in export_outputs: one serving_default signature with an output per entry.
    assert model.signature["signatures"] == {
        "serving_default": {
            "method": PREDICT,
            "outputs": {"probabilities": "probabilities", "scores": "scores"},
        }
    }
    out = model(x)
    np.testing.assert_allclose(out["scores"], expected, rtol=1e-5, atol=1e-6)
    e = np.exp(expected - expected.max(-1, keepdims=True))
    np.testing.assert_allclose(out["probabilities"], e / e.sum(-1, keepdims=True), rtol=1e-5)


def test_errors_name_what_is_wrong(tmp_path, trained):
    untrained = estimator.TPUEstimator(
        h.model_fn, config=h.config(tmp_path / "none"), train_batch_size=16, predict_batch_size=16
    )
    fn = build_raw_serving_input_receiver_fn({"x": np.zeros((1, 6), np.float32)})
    with pytest.raises(ValueError, match="Could not find trained model"):
        untrained.export_saved_model(str(tmp_path / "e"), fn)
    with pytest.raises(ValueError, match="'x' is a scalar"):
        build_raw_serving_input_receiver_fn({"x": np.float32(0)})

    est = trained
    model = load_saved_model(est.export_saved_model(str(tmp_path / "e"), fn))
    with pytest.raises(
        ValueError,
        match=r"feature 'x' has shape \(2, 5\); the export takes "
        r"\(batch, 6\)",
    ):
        model({"x": np.zeros((2, 5), np.float32)})
    with pytest.raises(ValueError, match=r"missing \['x'\], unexpected \['y'\]"):
        model({"y": np.zeros((2, 6), np.float32)})
    with pytest.raises(TypeError, match="feature 'x' has dtype complex64"):
        model(x=np.zeros((2, 6), np.complex64))
    assert model(x=np.zeros((2, 6)))["logits"].shape == (2, 3)  # float64 is cast

    def host_model_fn(features, labels, mode, params):
        spec = h.model_fn(features, labels, mode, params)
        if mode == estimator.ModeKeys.PREDICT:
            outside_compilation(print, features["x"], result_shape=None)
        return spec

    est2 = estimator.TPUEstimator(
        host_model_fn,
        config=h.config(est.model_dir),
        params={"batch_norm": True},
        train_batch_size=16,
        predict_batch_size=16,
    )
    with pytest.raises(RuntimeError, match="outside_compilation.*cannot be exported"):
        est2.export_saved_model(str(tmp_path / "e"), fn)

    def bad_outputs(features, labels, mode, params):
        spec = h.model_fn(features, labels, mode, params)
        if mode != estimator.ModeKeys.PREDICT:
            return spec
        return estimator.TPUEstimatorSpec(
            mode, predictions=spec.predictions, export_outputs={"p": "probabilities"}
        )

    est3 = estimator.TPUEstimator(
        bad_outputs,
        config=h.config(est.model_dir),
        params={"batch_norm": True},
        train_batch_size=16,
        predict_batch_size=16,
    )
    with pytest.raises(
        ValueError,
        match=r"export_outputs\['p'\] names predictions key "
        r"'probabilities'.*\['logits', 'row'\]",
    ):
        est3.export_saved_model(str(tmp_path / "e"), fn)

    def no_default(features, labels, mode, params):
        spec = h.model_fn(features, labels, mode, params)
        if mode != estimator.ModeKeys.PREDICT:
            return spec
        logits = spec.predictions["logits"]
        outputs = {
            "predict": estimator.PredictOutput(logits),
            "regress": estimator.RegressionOutput(logits[:, 0]),
        }
        return estimator.TPUEstimatorSpec(
            mode, predictions=spec.predictions, export_outputs=outputs
        )

    est4 = estimator.TPUEstimator(
        no_default,
        config=h.config(est.model_dir),
        params={"batch_norm": True},
        train_batch_size=16,
        predict_batch_size=16,
    )
    with pytest.raises(
        ValueError,
        match=r"\['predict', 'regress'\] and none is named "
        r"'serving_default'",
    ):
        est4.export_saved_model(str(tmp_path / "e"), fn)


def test_cli_export_from_config(tmp_path, capsys):
    model_dir, export_dir = str(tmp_path / "model"), str(tmp_path / "export")
    common = [
        "--config",
        "configs/digits_mlp_small.py",
        "--model_dir",
        model_dir,
        "--config.max_steps=4",
        "--config.iterations_per_loop=4",
        "--config.use_tpu=False",  # one device: the CLI path is the same, compiling is faster
    ]
    assert cli.main(["train", *common]) == 0
    capsys.readouterr()
    assert cli.main(["export", *common, "--export_dir", export_dir]) == 0
    path = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["export_dir"]
    assert os.path.dirname(path) == export_dir
    assert os.path.isfile(os.path.join(path, "saved_model.pb"))  # the TF SavedModel too
    model = load_saved_model(path)
    assert model.signature["inputs"] == {"features": {"shape": ["b", 64], "dtype": "float32"}}
    assert sorted(model.output_names) == ["class_ids", "logits"]

    # Reference: the job's MLP (one hidden ReLU layer) in numpy on the checkpoint's variables.
    from estimator.cli import jobs

    config = jobs.load_config("configs/digits_mlp_small.py")
    est, input_fns = jobs.build(config, model_dir)
    v = {n.removeprefix("MLP_0/"): est.get_variable_value(n) for n in est.get_variable_names()}
    assert sorted(v) == [
        "dense_0/bias",
        "dense_0/kernel",
        "global_step",
        "logits/bias",
        "logits/kernel",
    ]
    assert v["global_step"] == 4 and model.signature["global_step"] == 4
    x = np.concatenate(list(input_fns["predict"]({"batch_size": 128})))
    hidden = np.maximum(x @ v["dense_0/kernel"] + v["dense_0/bias"], 0.0)
    logits = hidden @ v["logits/kernel"] + v["logits/bias"]
    out = model(x)
    np.testing.assert_allclose(out["logits"], logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out["class_ids"], logits.argmax(-1))


def _model_parallel_fn(features, labels, mode, params):
    kernel = nn.initializers.lecun_normal()
    hidden = nn.Dense(16, kernel_init=nn.with_partitioning(kernel, (None, "model")), name="hidden")(
        features["x"]
    )
    logits = nn.Dense(3, kernel_init=nn.with_partitioning(kernel, ("model", None)), name="out")(
        nn.relu(hidden)
    )
    if mode == estimator.ModeKeys.PREDICT:
        return estimator.TPUEstimatorSpec(mode, predictions={"logits": logits})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.1))


def test_model_parallel_variables_export_to_one_device(tmp_path):
    x, y = h.make_data()
    cfg = h.config(tmp_path / "model", tpu={"num_cores_per_replica": 2})
    est = estimator.TPUEstimator(
        _model_parallel_fn, config=cfg, train_batch_size=16, predict_batch_size=16
    )
    est.train(h.train_input_fn(x, y), max_steps=4)
    expected = np.stack([p["logits"] for p in est.predict(h.eval_input_fn(x[:21]))])
    fn = build_raw_serving_input_receiver_fn({"x": x[:1]})
    path = est.export_saved_model(str(tmp_path / "export"), fn, fold_variables=True)
    np.testing.assert_allclose(
        load_saved_model(path)({"x": x[:21]})["logits"], expected, rtol=1e-5, atol=1e-6
    )


def test_signatures_follow_tfs_export_outputs_rules():
    """io/signatures.py alone, on numpy arrays: TF's get_export_outputs rules and names."""
    from types import SimpleNamespace

    from estimator.io.signatures import export_signatures

    logits, ids = np.ones((4, 3), np.float32), np.zeros(4, np.int32)

    def run(export_outputs, predictions=None):
        predictions = {"logits": logits} if predictions is None else predictions
        spec = SimpleNamespace(predictions=predictions, export_outputs=export_outputs)
        return export_signatures(spec)

    outputs, sigs = run(None, logits)  # a lone prediction array is "output", as in TF
    assert list(outputs) == ["output"]
    assert sigs == {"serving_default": {"method": PREDICT, "outputs": {"output": "output"}}}
    # One ExportOutput under another key is also serving_default; outputs keep their names.
    outputs, sigs = run({"classify": estimator.ClassificationOutput(scores=logits, classes=ids)})
    classify = {
        "method": "tensorflow/serving/classify",
        "outputs": {"scores": "scores", "classes": "classes"},
    }
    assert sigs == {"classify": classify, "serving_default": classify}
    assert outputs["scores"] is logits and outputs["classes"] is ids
    # Several: "<entry>/<output>"; a plain entry is a one-output PredictOutput of its own name.
    outputs, sigs = run(
        {
            "serving_default": estimator.PredictOutput(logits),
            "regress": estimator.RegressionOutput(logits[:, 0]),
            "ids": ids,
        }
    )
    assert sigs == {
        "serving_default": {"method": PREDICT, "outputs": {"output": "serving_default/output"}},
        "regress": {
            "method": "tensorflow/serving/regress",
            "outputs": {"outputs": "regress/outputs"},
        },
        "ids": {"method": PREDICT, "outputs": {"ids": "ids"}},
    }
    assert sorted(outputs) == ["ids", "regress/outputs", "serving_default/output"]
    # TF's dtypes: float scores and regression values; class ids are integers here.
    with pytest.raises(TypeError, match="ClassificationOutput scores must be a floating array"):
        estimator.ClassificationOutput(scores=ids)
    with pytest.raises(TypeError, match="ClassificationOutput classes must be an integer array"):
        estimator.ClassificationOutput(classes=logits)
    with pytest.raises(TypeError, match="RegressionOutput value must be a floating array"):
        estimator.RegressionOutput(ids)
    with pytest.raises(ValueError, match="needs scores or classes"):
        estimator.ClassificationOutput()
    with pytest.raises(TypeError, match=r"export_outputs\['p'\] must be an array"):
        run({"p": 3})
