"""Serving from encoded images (issue 41, item 10): ``estimator.export.
build_image_serving_input_receiver_fn`` makes the TF SavedModel take JPEG/PNG bytes and decode
them with TF ops inside it, as ResNet's ``image_serving_input_fn`` did.

The SavedModel is loaded with TensorFlow here and called with bytes that TF encoded; TF
Serving's REST request body (``{"instances": [{"b64": ...}]}``) is decoded by a small
function below into the signature call, as the model server does. No TF Serving binary is
available to these tests, so the server itself is not run.
"""

from __future__ import annotations

import base64
import json

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import estimator
from tests import helpers as h

tf = pytest.importorskip("tensorflow", reason="the tf extra is not installed")

SIZE, B = 8, 16


def model_fn(features, labels, mode, params):
    images = features["image"] if isinstance(features, dict) else features
    x = nn.relu(nn.Conv(4, (3, 3), name="conv")(images / 255.0))
    logits = nn.Dense(3, name="logits")(x.mean(axis=(1, 2)))
    if mode == estimator.ModeKeys.PREDICT:
        return estimator.TPUEstimatorSpec(mode, predictions={"logits": logits})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return estimator.TPUEstimatorSpec(mode, loss=loss, train_op=optax.sgd(0.1))


def _images(n, h_=SIZE, w=SIZE, seed=0):
    return np.random.RandomState(seed).randint(0, 256, (n, h_, w, 3)).astype(np.uint8)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    images = _images(B).astype(np.float32)
    labels = np.arange(B, dtype=np.int32) % 3
    est = h.make_estimator(tmp_path_factory.mktemp("image_serving"), model_fn, batch=B)
    return est.train(lambda params: (images, labels), max_steps=1)


def _predict(est, images):
    """The model on decoded images, through est.predict."""
    images = np.asarray(images, np.float32)
    batches = [images[i : i + B] for i in range(0, len(images), B)]
    out = est.predict(lambda params: iter(batches), yield_single_examples=False)
    return np.concatenate([o["logits"] for o in out])


def rest_predict(signature, body: str) -> str:
    """TF Serving's REST predict API, decoded into a signature call: the "instances" (row)
    format, with binary values as ``{"b64": ...}``, alone or under the input's name."""
    request = json.loads(body)

    def value(instance):
        if isinstance(instance, dict) and set(instance) != {"b64"}:
            (instance,) = instance.values()
        return base64.b64decode(instance["b64"])

    (name,) = signature.structured_input_signature[1]
    outputs = signature(**{name: tf.constant([value(i) for i in request["instances"]])})
    rows = len(request["instances"])
    predictions = [{k: v.numpy()[r].tolist() for k, v in outputs.items()} for r in range(rows)]
    return json.dumps({"predictions": predictions})


def test_the_tf_saved_model_decodes_jpeg_and_png_bytes_in_the_signature(trained, tmp_path):
    receiver_fn = estimator.export.build_image_serving_input_receiver_fn(SIZE)
    path = trained.export_saved_model(str(tmp_path / "export"), receiver_fn)
    loaded = tf.saved_model.load(path)
    serving = loaded.signatures["serving_default"]
    assert serving.structured_input_signature[1]["image_bytes"].dtype == tf.string

    originals = _images(4, seed=1)
    png = [tf.io.encode_png(x).numpy() for x in originals[:2]]
    jpeg = [tf.io.encode_jpeg(x, quality=90).numpy() for x in originals[2:]]
    got = serving(image_bytes=tf.constant(png + jpeg))["logits"].numpy()

    # PNG is lossless: the model on the original pixels; JPEG: on what TF decodes
    decoded = np.stack([tf.io.decode_image(b, channels=3).numpy() for b in png + jpeg])
    np.testing.assert_array_equal(decoded[:2], originals[:2])
    np.testing.assert_allclose(got, _predict(trained, decoded), rtol=1e-5, atol=1e-5)

    # TF Serving's REST body, base64 images, one row each (both instance forms)
    b64 = [base64.b64encode(b).decode("ascii") for b in png + jpeg]
    body = json.dumps(
        {"instances": [{"b64": b64[0]}, *({"image_bytes": {"b64": s}} for s in b64[1:])]}
    )
    answer = json.loads(rest_predict(serving, body))
    np.testing.assert_allclose(np.array([p["logits"] for p in answer["predictions"]]), got)

    # the portable export takes the decoded images, and records the TF serving input
    portable = estimator.load_saved_model(path)
    np.testing.assert_allclose(
        portable(decoded.astype(np.float32))["logits"], got, rtol=1e-5, atol=1e-5
    )
    with open(f"{path}/assets.extra/signature.json") as f:
        recorded = json.load(f)["tf_serving_input"]
    assert recorded["receiver"] == {"image_bytes": {"dtype": "string", "shape": ["b"]}}


def test_images_of_another_size_are_resized_and_values_mapped(trained, tmp_path):
    receiver_fn = estimator.export.build_image_serving_input_receiver_fn(
        (SIZE, SIZE), feature_key="image", value_range=(0.0, 510.0), receiver_key="jpeg"
    )
    # model_fn reads features["image"] (a dict of one); exported from the same checkpoint
    path = trained.export_saved_model(str(tmp_path / "export"), receiver_fn)
    serving = tf.saved_model.load(path).signatures["serving_default"]
    big = _images(2, 13, 11, seed=2)
    encoded = [tf.io.encode_png(x).numpy() for x in big]
    got = serving(jpeg=tf.constant(encoded))["logits"].numpy()
    expected_images = tf.image.resize(tf.cast(big, tf.float32), [SIZE, SIZE]).numpy() * 2.0
    np.testing.assert_allclose(got, _predict(trained, expected_images), rtol=1e-5, atol=1e-5)


def test_a_programs_own_tf_preprocessing_replaces_the_decoding(trained, tmp_path):
    def preprocess_image(image_bytes):  # e.g. ResNet's, here a center crop of the decoded image
        image = tf.io.decode_png(image_bytes, channels=3)
        return tf.cast(tf.image.resize_with_crop_or_pad(image, SIZE, SIZE), tf.float32)

    receiver_fn = estimator.export.build_image_serving_input_receiver_fn(
        SIZE, preprocess_fn=preprocess_image
    )
    path = trained.export_saved_model(str(tmp_path / "export"), receiver_fn)
    serving = tf.saved_model.load(path).signatures["serving_default"]
    big = _images(1, 12, 12, seed=3)
    got = serving(image_bytes=tf.constant([tf.io.encode_png(big[0]).numpy()]))["logits"]
    np.testing.assert_allclose(
        got.numpy(), _predict(trained, big[:, 2:10, 2:10]), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"image_size": 0}, "image_size"),
        ({"image_size": 8, "channels": 2}, "channels"),
        ({"image_size": 8, "resize_method": "cubic"}, "resize_method"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(estimator.EstimatorError, match=message):
        estimator.export.build_image_serving_input_receiver_fn(**kwargs)


def test_the_receiver_says_nothing_about_unserved_receiver_tensors(caplog):
    fn = estimator.export.build_image_serving_input_receiver_fn(SIZE, feature_key="image")
    receiver = fn()
    assert receiver.features["image"].shape == (1, SIZE, SIZE, 3)
    assert receiver.features["image"].dtype == jnp.float32
    assert "not served" not in caplog.text
