"""The Cloud TPU DCGAN program, ported: a GAN trained with two losses and two optimizers.

Modelled on ``models/experimental/dcgan/dcgan_main.py`` with its ``mnist_model.py`` and
``mnist_input.py`` in github.com/tensorflow/tpu (Apache-2.0), in one file. Every
estimator-facing line keeps the reference's form; a line that had to change carries a
``# changed:`` comment saying why. The estimator-facing changes: the joint train op is
``estimator.group(estimator.minimize(d_loss, d_optimizer, var_list=...), ...)`` where TF had
``tf.group([d_optimizer.minimize(...), g_optimizer.minimize(...), increment_step])`` (the
estimator advances the step itself, and BatchNorm's UPDATE_OPS are its state), and the
package is imported as ``import estimator`` / ``from estimator import tpu``. The rest is TF
math (Flax layers under ``estimator.variable_scope(..., reuse=estimator.AUTO_REUSE)``, optax)
and the data: scikit-learn's 8x8 digits (no download) in place of MNIST TFRecords, so the
networks take 8x8 images (two stride-2 layers from 2x2, where MNIST's went from 7x7).

Run it:
  python -m examples.dcgan_tpu --model_dir=/tmp/dcgan --train_steps=2000
  python -m examples.dcgan_tpu --use_tpu=false ...      # one device, same program
"""

from __future__ import annotations

import os

import flax.linen as nn  # changed: TF layers -> Flax
import jax  # changed: tf.nn -> jax.nn
import jax.numpy as jnp  # changed: tf ops -> jnp
import numpy as np
import optax  # changed: tf.train.AdamOptimizer -> optax
from absl import app, flags, logging  # changed: absl.logging for tf.logging
from PIL import Image

import estimator  # changed: tf.estimator / tensorflow.python.estimator -> estimator
import metrics  # changed: tf.metrics -> the host-side metrics package
from estimator import tpu  # changed: tf.contrib.tpu -> estimator.tpu (the same names)

FLAGS = flags.FLAGS

# Cloud TPU Cluster Resolvers
flags.DEFINE_string("tpu", default=None, help="The Cloud TPU to use, or None for local devices.")
flags.DEFINE_string("gcp_project", default=None, help="GCP project (ignored here).")
flags.DEFINE_string("tpu_zone", default=None, help="GCE zone (ignored here).")

# Model specific paramenters
flags.DEFINE_string("dataset", "mnist", 'Only "mnist" (the 8x8 digits here).')
flags.DEFINE_string("model_dir", "", "Output model directory")
flags.DEFINE_integer("noise_dim", 64, "Number of dimensions for the noise vector")
flags.DEFINE_integer("batch_size", 1024, "Batch size for both generator and discriminator")
flags.DEFINE_integer("num_shards", None, "Number of TPU chips")
flags.DEFINE_integer("train_steps", 10000, "Number of training steps")
flags.DEFINE_integer("train_steps_per_eval", 1000, "Steps per eval and image generation")
flags.DEFINE_integer(
    "iterations_per_loop",
    100,
    "Steps per interior TPU loop. Should be less than --train_steps_per_eval",
)
flags.DEFINE_float("learning_rate", 0.0002, "LR for both D and G")
flags.DEFINE_boolean("eval_loss", False, "Evaluate discriminator and generator loss during eval")
flags.DEFINE_boolean("use_tpu", True, "Use TPU for training")

_NUM_VIZ_IMAGES = 100  # For generating a 10x10 grid of generator samples

# ------------------------------------------------------------------ mnist_model.py
_INIT = jax.nn.initializers.truncated_normal(stddev=0.02)  # changed: TF's initializer
_SIDE = 2  # changed: 8x8 images come from 2x2 (MNIST's 28x28 came from 7x7)


def _leaky_relu(x):
    return nn.leaky_relu(x, negative_slope=0.2)  # changed: tf.nn -> nn


def _batch_norm(x, is_training, name):
    return nn.BatchNorm(  # changed: tf.layers.batch_normalization -> Flax
        use_running_average=not is_training, momentum=0.9, epsilon=1e-5, name=name
    )(x)


def _dense(x, channels, name):
    return nn.Dense(channels, kernel_init=_INIT, name=name)(x)  # changed: Flax


def _conv2d(x, filters, kernel_size, stride, name):
    return nn.Conv(  # changed: Flax
        filters, (kernel_size, kernel_size), (stride, stride), "SAME", kernel_init=_INIT, name=name
    )(x)


def _deconv2d(x, filters, kernel_size, stride, name):
    return nn.ConvTranspose(  # changed: Flax
        filters, (kernel_size, kernel_size), (stride, stride), "SAME", kernel_init=_INIT, name=name
    )(x)


def discriminator(x, is_training=True, scope="Discriminator"):
    # conv64-lrelu + conv128-bn-lrelu + fc1024-bn-lrelu + fc1
    with estimator.variable_scope(scope, reuse=estimator.AUTO_REUSE):  # changed: namespace
        x = _conv2d(x, 64, 4, 2, name="d_conv1")
        x = _leaky_relu(x)

        x = _conv2d(x, 128, 4, 2, name="d_conv2")
        x = _leaky_relu(_batch_norm(x, is_training, name="d_bn2"))

        x = jnp.reshape(x, [-1, _SIDE * _SIDE * 128])  # changed: tf.reshape; 8x8 input

        x = _dense(x, 1024, name="d_fc3")
        x = _leaky_relu(_batch_norm(x, is_training, name="d_bn3"))

        x = _dense(x, 1, name="d_fc4")

        return x


def generator(x, is_training=True, scope="Generator"):
    # fc1024-bn-relu + fc512-bn-relu + deconv64-bn-relu + deconv1-tanh
    with estimator.variable_scope(scope, reuse=estimator.AUTO_REUSE):  # changed: namespace
        x = _dense(x, 1024, name="g_fc1")
        x = nn.relu(_batch_norm(x, is_training, name="g_bn1"))  # changed: tf.nn -> nn

        x = _dense(x, _SIDE * _SIDE * 128, name="g_fc2")  # changed: 8x8 output
        x = nn.relu(_batch_norm(x, is_training, name="g_bn2"))  # changed: tf.nn -> nn

        x = jnp.reshape(x, [-1, _SIDE, _SIDE, 128])  # changed: tf.reshape; 8x8 output

        x = _deconv2d(x, 64, 4, 2, name="g_dconv3")
        x = nn.relu(_batch_norm(x, is_training, name="g_bn3"))  # changed: tf.nn -> nn

        x = _deconv2d(x, 1, 4, 2, name="g_dconv4")
        x = jnp.tanh(x)  # changed: tf.tanh -> jnp

        return x


# ------------------------------------------------------------------ mnist_input.py
NUM_TRAIN_IMAGES = 1500  # changed: the digits' first 1500 images train
NUM_EVAL_IMAGES = 297  # changed: the rest evaluate


def _images(is_training):
    """The digits as [N, 8, 8, 1] in [-1.0, 1.0] (changed: in place of TFRecords)."""
    from sklearn.datasets import load_digits

    images = load_digits().images.astype(np.float32)[..., None]
    # Normalize the values of the image from [0, 16] to [-1.0, 1.0]
    images = images * (2.0 / 16) - 1.0  # changed: digits pixels are 0..16, not 0..255
    return images[:NUM_TRAIN_IMAGES] if is_training else images[NUM_TRAIN_IMAGES:]


class InputFunction:
    """Wrapper class that is passed as callable to Estimator."""

    def __init__(self, is_training, noise_dim):
        self.is_training = is_training
        self.noise_dim = noise_dim

    def __call__(self, params):
        """Yields the batches (changed: a numpy generator in place of the tf.data pipeline)."""
        batch_size = params["batch_size"]
        images = _images(self.is_training)
        rng = np.random.RandomState(0)
        while True:  # changed: .repeat().shuffle().batch(drop_remainder=True) in numpy
            order = rng.permutation(len(images)) if self.is_training else np.arange(len(images))
            for i in range(0, len(order) - batch_size + 1, batch_size):
                # changed: fresh noise per batch, as tf.random_normal drew per step
                random_noise = rng.randn(batch_size, self.noise_dim).astype(np.float32)
                features = {
                    "real_images": images[order[i : i + batch_size]],
                    "random_noise": random_noise,
                }
                yield features, None  # changed: the labels are unused
            if not self.is_training:
                return


def convert_array_to_image(array):
    """Converts a numpy array to a PIL Image and undoes any rescaling."""
    array = array[:, :, 0]
    img = Image.fromarray(np.uint8((array + 1.0) / 2.0 * 255), mode="L")
    return img


# ------------------------------------------------------------------ dcgan_main.py
def model_fn(features, labels, mode, params):
    """Constructs DCGAN from individual generator and discriminator networks."""
    del labels  # Unconditional GAN does not use labels

    if mode == estimator.ModeKeys.PREDICT:  # changed: namespace
        ###########
        # PREDICT #
        ###########
        # Pass only noise to PREDICT mode
        random_noise = features["random_noise"]
        predictions = {"generated_images": generator(random_noise, is_training=False)}

        return tpu.TPUEstimatorSpec(mode=mode, predictions=predictions)  # changed: namespace

    # Use params['batch_size'] for the batch size inside model_fn
    batch_size = params["batch_size"]  # noqa: F841
    real_images = features["real_images"]
    random_noise = features["random_noise"]

    is_training = mode == estimator.ModeKeys.TRAIN  # changed: namespace
    generated_images = generator(random_noise, is_training=is_training)

    # Get logits from discriminator
    d_on_data_logits = jnp.squeeze(discriminator(real_images))  # changed: tf.squeeze -> jnp
    d_on_g_logits = jnp.squeeze(discriminator(generated_images))  # changed: tf.squeeze -> jnp

    # Calculate discriminator loss
    d_loss_on_data = optax.sigmoid_binary_cross_entropy(  # changed: tf.nn -> optax
        labels=jnp.ones_like(d_on_data_logits), logits=d_on_data_logits
    )
    d_loss_on_gen = optax.sigmoid_binary_cross_entropy(  # changed: tf.nn -> optax
        labels=jnp.zeros_like(d_on_g_logits), logits=d_on_g_logits
    )

    d_loss = d_loss_on_data + d_loss_on_gen

    # Calculate generator loss
    g_loss = optax.sigmoid_binary_cross_entropy(  # changed: tf.nn -> optax
        labels=jnp.ones_like(d_on_g_logits), logits=d_on_g_logits
    )

    if mode == estimator.ModeKeys.TRAIN:  # changed: namespace
        #########
        # TRAIN #
        #########
        d_loss = jnp.mean(d_loss)  # changed: tf.reduce_mean -> jnp
        g_loss = jnp.mean(g_loss)  # changed: tf.reduce_mean -> jnp
        d_optimizer = optax.adam(learning_rate=FLAGS.learning_rate, b1=0.5)  # changed: optax
        g_optimizer = optax.adam(learning_rate=FLAGS.learning_rate, b1=0.5)  # changed: optax

        if FLAGS.use_tpu:
            d_optimizer = estimator.CrossShardOptimizer(d_optimizer)  # changed: namespace
            g_optimizer = estimator.CrossShardOptimizer(g_optimizer)  # changed: namespace

        with estimator.control_dependencies(  # changed: namespace
            estimator.get_collection(estimator.GraphKeys.UPDATE_OPS)  # changed: namespace
        ):
            d_step = estimator.minimize(  # changed: optimizer.minimize -> estimator.minimize
                d_loss,
                d_optimizer,  # changed: the optimizer is an argument
                var_list=estimator.get_collection(  # changed: namespace
                    estimator.GraphKeys.GLOBAL_VARIABLES,
                    scope="Discriminator",  # changed: ns
                ),
            )
            g_step = estimator.minimize(  # changed: optimizer.minimize -> estimator.minimize
                g_loss,
                g_optimizer,  # changed: the optimizer is an argument
                var_list=estimator.get_collection(  # changed: namespace
                    estimator.GraphKeys.GLOBAL_VARIABLES,
                    scope="Generator",  # changed: ns
                ),
            )

            # changed: no increment_step: the estimator advances global_step once per step
            joint_op = estimator.group([d_step, g_step])  # changed: tf.group -> estimator.group

        return tpu.TPUEstimatorSpec(mode=mode, loss=g_loss, train_op=joint_op)  # changed: ns

    elif mode == estimator.ModeKeys.EVAL:  # changed: namespace
        ########
        # EVAL #
        ########
        def _eval_metric_fn(d_loss, g_loss):
            # When using TPUs, this function is run on a different machine than the
            # rest of the model_fn and should not capture any Tensors defined there
            return {
                "discriminator_loss": metrics.mean(d_loss),  # changed: tf.metrics -> metrics
                "generator_loss": metrics.mean(g_loss),  # changed: tf.metrics -> metrics
            }

        return tpu.TPUEstimatorSpec(  # changed: namespace
            mode=mode,
            loss=jnp.mean(g_loss),  # changed: tf.reduce_mean -> jnp
            eval_metrics=(_eval_metric_fn, [d_loss, g_loss]),
        )

    # Should never reach here
    raise ValueError("Invalid mode provided to model_fn")


def generate_input_fn(is_training):
    """Creates input_fn depending on whether the code is training or not."""
    return InputFunction(is_training, FLAGS.noise_dim)  # changed: one dataset, in this file


def noise_input_fn(params):
    """Input function for generating samples for PREDICT mode.

    Generates a single batch of fixed random noise (changed: numpy, not tf.data: one
    ``(features, None)`` pair is one batch, which tells predict() when to stop).
    """
    np.random.seed(0)
    noise = np.random.randn(params["batch_size"], FLAGS.noise_dim).astype(np.float32)
    return {"random_noise": noise}, None


def main(argv):
    del argv
    tpu_cluster_resolver = estimator.TPUClusterResolver(  # changed: namespace
        FLAGS.tpu,
        zone=FLAGS.tpu_zone,
        project=FLAGS.gcp_project,
    )

    config = tpu.RunConfig(  # changed: namespace
        cluster=tpu_cluster_resolver,
        model_dir=FLAGS.model_dir,
        tpu_config=tpu.TPUConfig(  # changed: namespace
            num_shards=FLAGS.num_shards, iterations_per_loop=FLAGS.iterations_per_loop
        ),
    )

    # TPU-based estimator used for TRAIN and EVAL
    est = tpu.TPUEstimator(  # changed: namespace
        model_fn=model_fn,
        use_tpu=FLAGS.use_tpu,
        config=config,
        train_batch_size=FLAGS.batch_size,
        eval_batch_size=FLAGS.batch_size,
    )

    # CPU-based estimator used for PREDICT (generating images)
    cpu_est = tpu.TPUEstimator(  # changed: namespace
        model_fn=model_fn, use_tpu=False, config=config, predict_batch_size=_NUM_VIZ_IMAGES
    )

    os.makedirs(os.path.join(FLAGS.model_dir, "generated_images"), exist_ok=True)  # changed

    current_step = estimator._load_global_step_from_checkpoint_dir(FLAGS.model_dir)
    logging.info(  # changed: tf.logging -> absl logging
        "Starting training for %d steps, current step: %d" % (FLAGS.train_steps, current_step)  # noqa: UP031
    )
    results, images = None, None  # changed: kept for the caller
    while current_step < FLAGS.train_steps:
        next_checkpoint = min(current_step + FLAGS.train_steps_per_eval, FLAGS.train_steps)
        est.train(input_fn=generate_input_fn(True), max_steps=next_checkpoint)
        current_step = next_checkpoint
        logging.info("Finished training step %d" % current_step)  # noqa: UP031 changed: absl

        if FLAGS.eval_loss:
            # Evaluate loss on test set
            results = est.evaluate(
                input_fn=generate_input_fn(False), steps=NUM_EVAL_IMAGES // FLAGS.batch_size
            )
            logging.info("Finished evaluating")  # changed: absl logging
            logging.info(results)  # changed: absl logging

        # Render some generated images
        generated_iter = cpu_est.predict(input_fn=noise_input_fn)
        images = [p["generated_images"][:, :, :] for p in generated_iter]
        assert len(images) == _NUM_VIZ_IMAGES
        image_rows = [
            np.concatenate(images[i : i + 10], axis=0) for i in range(0, _NUM_VIZ_IMAGES, 10)
        ]
        tiled_image = np.concatenate(image_rows, axis=1)

        img = convert_array_to_image(tiled_image)

        step_string = str(current_step).zfill(5)
        path = os.path.join(FLAGS.model_dir, "generated_images", "gen_%s.png" % (step_string))  # noqa: UP031
        file_obj = open(path, "wb")  # changed: tf.gfile.Open -> open, binary
        img.save(file_obj, format="png")
        file_obj.close()  # changed: closed here (tf.gfile closed it on collection)
        logging.info("Finished generating images")  # changed: absl logging
    return results, np.stack(images) if images else None  # changed: for the caller


if __name__ == "__main__":
    logging.set_verbosity(logging.INFO)  # changed: tf.logging -> absl logging
    app.run(main)
