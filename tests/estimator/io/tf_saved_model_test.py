"""export_saved_model writes a TensorFlow SavedModel that TF alone serves (the ``tf`` extra).

One fresh interpreter, which cannot import jax, flax or this project, loads every SavedModel with
``tf.saved_model.load``, reads the signatures as ``saved_model_cli show`` does (the SignatureDef
protos of ``saved_model.pb``) and calls every signature on batches of 1 and 7; the results are
compared with ``est.predict`` and numpy here.
"""

import json
import logging
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import estimator
import models
from tests import helpers as h

N = 7  # rows served: batches of 1 (seven calls) and of 7 (one call)
PREDICT = "tensorflow/serving/predict"
MIB = 1 << 20

# Runs in a fresh interpreter: TensorFlow and numpy only.
_SERVER = textwrap.dedent("""
    import importlib.abc, json, sys

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("jax", "jaxlib", "flax", "estimator", "models", "tests"):
                raise ImportError(f"{name} must not be needed to serve a SavedModel")

    sys.meta_path.insert(0, Blocked())
    import numpy as np
    import tensorflow as tf
    from tensorflow.core.protobuf import saved_model_pb2

    def describe(tensors):
        return {k: [tf.dtypes.as_dtype(t.dtype).name, [d.size for d in t.tensor_shape.dim]]
                for k, t in tensors.items()}

    paths, data = sys.argv[1].split(","), np.load(sys.argv[2])
    report, results = {}, {}
    for i, path in enumerate(paths):
        proto = saved_model_pb2.SavedModel()
        with open(path + "/saved_model.pb", "rb") as f:
            proto.ParseFromString(f.read())
        (graph,) = proto.meta_graphs
        signatures = {
            key: {"method": s.method_name, "inputs": describe(s.inputs),
                  "outputs": describe(s.outputs)}
            for key, s in graph.signature_def.items() if not key.startswith("__")
        }
        variables = [n for n, _ in tf.train.list_variables(path + "/variables/variables")
                     if n.endswith("VARIABLE_VALUE")]
        loaded = tf.saved_model.load(path)
        for key, info in signatures.items():
            feed = {name: data[f"{i}/{name}"] for name in info["inputs"]}
            for batch in (1, 7):
                parts = [loaded.signatures[key](**{n: tf.constant(v[j:j + batch])
                                                   for n, v in feed.items()})
                         for j in range(0, 7, batch)]
                for out in parts[0]:
                    value = np.concatenate([p[out].numpy() for p in parts])
                    results[f"{i}/{key}/{batch}/{out}"] = (
                        value.astype("S") if value.dtype == object else value)
        report[path] = {"signatures": signatures, "variables": len(variables)}
    np.savez(sys.argv[3], **results)
    loaded_modules = sorted({m.split(".")[0] for m in sys.modules} & {
        "jax", "jaxlib", "flax", "estimator", "models", "tests"})
    print(json.dumps({"models": report, "loaded": loaded_modules}))
""")


def _serve(tmp_path, exports: list[tuple[str, dict]]) -> tuple[dict, np.lib.npyio.NpzFile]:
    """Runs ``_SERVER`` on ``[(path, {input name: rows})]``; returns its report and results."""
    data = {f"{i}/{k}": v for i, (_, feed) in enumerate(exports) for k, v in feed.items()}
    np.savez(tmp_path / "inputs.npz", **data)
    (tmp_path / "serve.py").write_text(_SERVER)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    run = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "serve.py"),
            ",".join(p for p, _ in exports),
            str(tmp_path / "inputs.npz"),
            str(tmp_path / "out.npz"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), np.load(tmp_path / "out.npz")


def _zoo_estimator(model_dir, model_fn, params):
    return estimator.TPUEstimator(
        model_fn,
        config=h.config(model_dir),
        params={"learning_rate": 1e-3, "write_summaries": False, **params},
        train_batch_size=16,
        predict_batch_size=8,
    )


def _trained(model_dir, model_fn, params, x):
    est = _zoo_estimator(model_dir, model_fn, params)
    y = np.random.RandomState(0).randint(0, 10, len(x)).astype(np.int32)

    def input_fn(params):
        while True:
            yield x[:16], y[:16]

    est.train(input_fn, max_steps=1)
    return est


def _predictions(est, x) -> dict[str, np.ndarray]:
    out = list(est.predict(lambda params: iter([x]), yield_single_examples=False))
    return {k: np.concatenate([o[k] for o in out]) for k in out[0]}


def _with_signatures(features, labels, mode, params):
    """The zoo MLP, serving three signatures in PREDICT mode (TF's ExportOutput kinds)."""
    spec = models.mlp_model_fn(features, labels, mode, params)
    if mode != estimator.ModeKeys.PREDICT:
        return spec
    logits = spec.predictions["logits"]
    probs = jax.nn.softmax(logits)
    return estimator.TPUEstimatorSpec(
        mode,
        predictions=spec.predictions,
        export_outputs={
            "serving_default": estimator.PredictOutput({"probabilities": probs, "logits": logits}),
            "classify": estimator.ClassificationOutput(scores=probs, classes=logits.argmax(-1)),
            "regress": estimator.RegressionOutput(logits.max(-1)),
        },
    )


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _sig(inputs: dict, outputs: dict) -> dict:
    return {"method": PREDICT, "inputs": inputs, "outputs": outputs}


def test_zoo_models_served_by_tensorflow_alone_equal_predict(tmp_path):
    pytest.importorskip("tensorflow", reason="the tf extra is not installed")
    rng = np.random.RandomState(1)
    x = rng.rand(16, 64).astype(np.float32)
    # Wide enough that the parameters (1.2 MiB) outweigh the 1 MiB bound on saved_model.pb.
    mlp_params = {"hidden": (4096,)}
    mlp = _trained(tmp_path / "mlp", models.mlp_model_fn, mlp_params, x)
    cnn = _trained(
        tmp_path / "cnn",
        models.cnn_model_fn,
        {"features": (4,), "dense": 8},
        x.reshape(16, 8, 8, 1),
    )
    rows = x[:N]
    images = rows.reshape(N, 8, 8, 1)
    expected = {"mlp": _predictions(mlp, rows), "cnn": _predictions(cnn, images)}
    signatures = _zoo_estimator(mlp.model_dir, _with_signatures, mlp_params)

    base = str(tmp_path / "export")
    serving = estimator.build_raw_serving_input_receiver_fn(rows[:1])
    paths = [
        mlp.export_saved_model(base, serving),
        mlp.export_saved_model(base, serving, fold_variables=True),
        signatures.export_saved_model(base, serving),
        cnn.export_saved_model(base, estimator.build_raw_serving_input_receiver_fn(images[:1])),
        # Lowered for GPU and TPU serving too; TF on CPU picks the CPU lowering.
        mlp.export_saved_model(base, serving, platforms=("cpu", "cuda", "tpu")),
    ]
    report, got = _serve(
        tmp_path, [(p, {"features": images if i == 3 else rows}) for i, p in enumerate(paths)]
    )
    assert report["loaded"] == []  # TensorFlow alone served them
    reports = [report["models"][p] for p in paths]

    # saved_model_cli's view: names, dtypes, shapes (-1: the batch), as TF defines the kinds.
    features = {"features": ["float32", [-1, 64]]}
    default = {"class_ids": ["int32", [-1]], "logits": ["float32", [-1, 10]]}
    assert reports[0]["signatures"] == {"serving_default": _sig(features, default)}
    assert reports[1]["signatures"] == reports[0]["signatures"]
    assert reports[2]["signatures"] == {
        "serving_default": _sig(
            features, {"probabilities": ["float32", [-1, 10]], "logits": ["float32", [-1, 10]]}
        ),
        "classify": _sig(features, {"classes": ["string", [-1]], "scores": ["float32", [-1, 10]]}),
        "regress": _sig(features, {"outputs": ["float32", [-1]]}),
    }
    assert reports[4]["signatures"] == reports[0]["signatures"]
    assert reports[3]["signatures"] == {
        "serving_default": _sig({"features": ["float32", [-1, 8, 8, 1]]}, default)
    }

    # Variables are TF variables, not constants in the graph (unless folded).
    param_bytes = sum(
        mlp.get_variable_value(n).nbytes for n in mlp.get_variable_names() if n != "global_step"
    )
    assert param_bytes > MIB
    pb = [os.path.getsize(os.path.join(p, "saved_model.pb")) for p in paths]
    assert pb[0] < MIB and pb[2] < MIB, pb
    assert reports[0]["variables"] == 4 and reports[2]["variables"] == 4
    assert reports[1]["variables"] == 0 and pb[1] > param_bytes  # rewrite_for_inference
    data = os.path.join(paths[0], "variables", "variables.data-00000-of-00001")
    assert os.path.getsize(data) >= param_bytes

    # Every signature, on batches of 1 and 7, against est.predict.
    for batch in (1, 7):
        for i, name in ((0, "mlp"), (1, "mlp"), (3, "cnn"), (4, "mlp")):
            want = expected[name]
            np.testing.assert_allclose(
                got[f"{i}/serving_default/{batch}/logits"], want["logits"], rtol=1e-5, atol=1e-5
            )
            np.testing.assert_array_equal(
                got[f"{i}/serving_default/{batch}/class_ids"], want["class_ids"]
            )
        logits = expected["mlp"]["logits"]
        tol = {"rtol": 1e-5, "atol": 1e-5}
        np.testing.assert_allclose(got[f"2/serving_default/{batch}/logits"], logits, **tol)
        np.testing.assert_allclose(
            got[f"2/serving_default/{batch}/probabilities"], _softmax(logits), **tol
        )
        np.testing.assert_allclose(got[f"2/classify/{batch}/scores"], _softmax(logits), **tol)
        np.testing.assert_array_equal(
            got[f"2/classify/{batch}/classes"], logits.argmax(-1).astype("S")
        )
        np.testing.assert_allclose(got[f"2/regress/{batch}/outputs"], logits.max(-1), **tol)

    # Our portable export sits beside it and still loads without TensorFlow's help.
    portable = estimator.load_saved_model(paths[2])
    assert sorted(portable.signature["signatures"]) == ["classify", "regress", "serving_default"]
    np.testing.assert_allclose(
        portable(rows)["regress/outputs"], logits.max(-1), rtol=1e-5, atol=1e-5
    )


def test_without_tensorflow_the_portable_export_is_written_and_one_line_says_how(
    tmp_path, monkeypatch, caplog
):
    x, y = h.make_data()
    est = estimator.TPUEstimator(
        h.model_fn, config=h.config(tmp_path / "m"), train_batch_size=16, predict_batch_size=16
    )
    est.train(h.train_input_fn(x, y), max_steps=1)
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # ``import tensorflow`` fails
    fn = estimator.build_raw_serving_input_receiver_fn({"x": x[:1]})
    with caplog.at_level(logging.INFO, logger="estimator"):
        path = est.export_saved_model(str(tmp_path / "export"), fn)
    lines = [r.getMessage() for r in caplog.records if "SavedModel" in r.getMessage()]
    assert len(lines) == 1 and "pip install 'tpu-estimator-jax[tf]'" in lines[0], lines
    assert not os.path.exists(os.path.join(path, "saved_model.pb"))
    # est.predict after an export (the export's 1-row trace must not stand in for predict's).
    want = np.stack([p["logits"] for p in est.predict(h.eval_input_fn(x[:16]))])
    got = estimator.load_saved_model(path)({"x": x[:16]})["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
