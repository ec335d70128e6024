"""The Cloud TPU MNIST reference program, ported: a small CNN trained with TPUEstimator.

Modelled on ``models/official/mnist/mnist_tpu.py`` in github.com/tensorflow/tpu (Apache-2.0).
Every estimator-facing line keeps the reference's form; a line that had to change carries a
``# changed:`` comment saying why. What changed, in short: TF layers/losses/optimizers became
Flax/optax (the estimator differentiates ``loss`` itself), ``tf.data`` on TFRecords became
numpy generators over scikit-learn's 8x8 digits (no download), and the package is imported
as ``from estimator import tpu`` (``tpu.TPUEstimator`` as in ``tf.estimator.tpu``).

Run it:
  python -m examples.mnist_tpu --model_dir=/tmp/mnist --train_steps=300 --eval_steps=2
  python -m examples.mnist_tpu --use_tpu=false ...      # one device, same program
"""

from __future__ import annotations

import flax.linen as nn  # changed: TF layers -> Flax
import jax  # changed: tf.nn/tf.argmax -> jax
import numpy as np  # changed: tf.data -> numpy batches
import optax  # changed: tf.train optimizers/decays -> optax
from absl import app, flags, logging

import estimator as estimator_lib  # changed: the local `estimator` below must not shadow it
import metrics  # changed: tf.metrics -> the host-side metrics package
from estimator import tpu  # changed: tf.estimator.tpu -> estimator.tpu (the same names)

# Cloud TPU cluster resolver flags: accepted; zone and project mean nothing off Cloud TPU.
flags.DEFINE_string("tpu", default=None, help="TPU name, or None for the local devices.")
flags.DEFINE_string("tpu_zone", default=None, help="[Optional] GCE zone (ignored here).")
flags.DEFINE_string("gcp_project", default=None, help="[Optional] GCP project (ignored here).")

# Model specific parameters.
flags.DEFINE_string("data_dir", "", "Unused: the digits ship with scikit-learn.")
flags.DEFINE_string("model_dir", None, "Estimator model_dir")
flags.DEFINE_integer("batch_size", 1024, "Global batch size (not per shard).")
flags.DEFINE_integer("train_steps", 1000, "Total number of training steps.")
flags.DEFINE_integer("eval_steps", 0, "Evaluation steps after training; 0 skips evaluation.")
flags.DEFINE_float("learning_rate", 0.05, "Learning rate.")

flags.DEFINE_bool("use_tpu", True, "Replicate over every device rather than use one.")
flags.DEFINE_bool("enable_predict", True, "Predict a few test examples at the end.")
flags.DEFINE_integer("iterations", 50, "Training steps per device loop.")
flags.DEFINE_integer("num_shards", 8, "Number of shards (replicas).")

FLAGS = flags.FLAGS


def metric_fn(labels, logits):
    accuracy = metrics.accuracy(  # changed: tf.metrics -> metrics (numpy, on the host)
        labels=labels, predictions=np.argmax(logits, axis=1)
    )
    return {"accuracy": accuracy}


def model_fn(features, labels, mode, params):
    """The CNN: two conv/pool blocks, a 1024-unit dense layer with dropout, 10 logits."""

    del params

    # Normalize to [0.0, 1.0].
    image = features / 16.0  # changed: digits pixels are 0..16, not 0..255

    y = nn.Conv(features=32, kernel_size=(5, 5), padding="SAME")(image)  # changed: Flax
    y = nn.relu(y)  # changed: Flax layers take no activation argument
    y = nn.max_pool(y, window_shape=(2, 2), strides=(2, 2), padding="SAME")  # changed: Flax
    y = nn.Conv(features=32, kernel_size=(5, 5), padding="SAME")(y)  # changed: Flax
    y = nn.relu(y)  # changed: Flax layers take no activation argument
    y = nn.max_pool(y, window_shape=(2, 2), strides=(2, 2), padding="SAME")  # changed: Flax
    y = y.reshape((y.shape[0], -1))  # changed: tf.layers.Flatten -> reshape
    y = nn.relu(nn.Dense(1024)(y))  # changed: Flax
    y = nn.Dropout(0.4)(  # changed: Flax
        y,
        deterministic=not (mode == estimator_lib.ModeKeys.TRAIN),  # changed: namespace
    )

    logits = nn.Dense(10)(y)  # changed: Flax

    if mode == estimator_lib.ModeKeys.PREDICT:  # changed: namespace
        predictions = {
            "class_ids": jax.numpy.argmax(logits, axis=1),  # changed: tf.argmax -> jnp
            "probabilities": jax.nn.softmax(logits),  # changed: tf.nn -> jax.nn
        }
        return tpu.TPUEstimatorSpec(mode, predictions=predictions)  # changed: namespace

    loss = optax.softmax_cross_entropy_with_integer_labels(  # changed: tf.losses -> optax
        logits=logits, labels=labels
    ).mean()

    if mode == estimator_lib.ModeKeys.TRAIN:  # changed: namespace
        learning_rate = optax.exponential_decay(  # changed: tf.train -> optax schedule
            FLAGS.learning_rate,
            transition_steps=100000,  # changed: optax's name for decay_steps
            decay_rate=0.96,
        )
        optimizer = optax.sgd(learning_rate=learning_rate)  # changed: optax
        if FLAGS.use_tpu:
            optimizer = estimator_lib.CrossShardOptimizer(optimizer)  # changed: package name
        return tpu.TPUEstimatorSpec(  # changed: namespace
            mode=mode,
            loss=loss,
            train_op=optimizer,  # changed: the estimator differentiates loss and steps
        )

    if mode == estimator_lib.ModeKeys.EVAL:  # changed: namespace
        return tpu.TPUEstimatorSpec(  # changed: namespace
            mode=mode, loss=loss, eval_metrics=(metric_fn, [labels, logits])
        )


_SPLITS = {"train": slice(0, 1297), "validation": slice(1297, 1597), "test": slice(1597, None)}


def dataset(split):
    """The digits of one split as (images [N, 8, 8, 1] float32, labels [N] int32)."""
    from sklearn.datasets import load_digits  # changed: no TFRecords; the data ships locally

    digits = load_digits()
    images = digits.images.astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    return images[_SPLITS[split]], labels[_SPLITS[split]]


def train_input_fn(params):
    """Repeats and reshuffles the training split; full batches only."""
    batch_size = params["batch_size"]
    images, labels = dataset("train")

    rng = np.random.RandomState(0)  # changed: .cache().repeat().shuffle().batch() in numpy
    while True:
        order = rng.permutation(len(images))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            rows = order[i : i + batch_size]
            yield images[rows], labels[rows]


def eval_input_fn(params):
    batch_size = params["batch_size"]
    images, labels = dataset("validation")

    for i in range(0, len(images) - batch_size + 1, batch_size):  # changed: drop_remainder
        yield images[i : i + batch_size], labels[i : i + batch_size]


def predict_input_fn(params):
    batch_size = params["batch_size"]
    images, _ = dataset("test")

    # The first 10 test examples; the last batch may be short.
    images = images[:10]  # changed: dataset.take(10)
    for i in range(0, len(images), batch_size):  # changed: dataset.batch(batch_size)
        yield images[i : i + batch_size]


def main(argv):
    del argv  # Unused.
    logging.set_verbosity(logging.INFO)

    tpu_cluster_resolver = estimator_lib.TPUClusterResolver(  # changed: package name
        FLAGS.tpu if (FLAGS.tpu or FLAGS.use_tpu) else "",
        zone=FLAGS.tpu_zone,
        project=FLAGS.gcp_project,
    )

    run_config = tpu.RunConfig(  # changed: namespace
        cluster=tpu_cluster_resolver,
        model_dir=FLAGS.model_dir,
        session_config=estimator_lib.ConfigProto(  # changed: namespace (ignored, warned)
            allow_soft_placement=True, log_device_placement=True
        ),
        tpu_config=tpu.TPUConfig(FLAGS.iterations, FLAGS.num_shards),  # changed: namespace
    )

    estimator = tpu.TPUEstimator(  # changed: namespace
        model_fn=model_fn,
        use_tpu=FLAGS.use_tpu,
        train_batch_size=FLAGS.batch_size,
        eval_batch_size=FLAGS.batch_size,
        predict_batch_size=FLAGS.batch_size,
        params={"data_dir": FLAGS.data_dir},
        config=run_config,
    )
    # train() needs max_steps (or steps) here too.
    estimator.train(input_fn=train_input_fn, max_steps=FLAGS.train_steps)
    # With drop_remainder the evaluation covers eval_steps * batch_size examples.
    results = None  # changed: kept for the caller (the test reads the accuracy)
    if FLAGS.eval_steps:
        results = estimator.evaluate(input_fn=eval_input_fn, steps=FLAGS.eval_steps)

    # Predict the first few test examples.
    predicted = []  # changed: kept for the caller
    if FLAGS.enable_predict:
        predictions = estimator.predict(input_fn=predict_input_fn)

        for pred_dict in predictions:
            template = 'Prediction is "{}" ({:.1f}%).'

            class_id = pred_dict["class_ids"]
            probability = pred_dict["probabilities"][class_id]

            logging.info(template.format(class_id, 100 * probability))
            predicted.append(int(class_id))  # changed: kept for the caller
    return results, predicted  # changed: returned for the caller (app.run ignores it)


if __name__ == "__main__":
    app.run(main)
