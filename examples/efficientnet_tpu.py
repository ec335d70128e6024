"""The Cloud TPU EfficientNet main, ported: a tiny EfficientNet trained with TPUEstimator.

Modelled on ``models/official/efficientnet/main.py`` in github.com/tensorflow/tpu
(Apache-2.0). Every estimator-facing line keeps the reference's form; a line that had to
change carries a ``# changed:`` comment saying why, a line that is not in the reference an
``# added:`` one. What changed, in short: TF layers/losses/optimizers became Flax/optax,
ImageNet TFRecords became scikit-learn's 8x8 digits (no download), the network is two
MBConv blocks instead of efficientnet_builder's, and ``utils.archive_ckpt`` (which copies
``model.ckpt-N.*`` files, and so would archive nothing from checkpoint *directories*)
became a ``BestExporter``: the best evaluation's model is exported to
``model_dir/export/best/<version>/``. The moving averages read as the reference's: ``utils.
get_ema_vars()`` (trainable variables and BatchNorm's ``moving_mean``/``moving_variance``),
``with control_dependencies([train_op]): train_op = ema.apply(ema_vars)`` and, for
evaluation, ``Scaffold(saver=Saver(ema.variables_to_restore(ema_vars)))``; only the
namespace changed. ``--init_checkpoint`` is BERT's TPU warm start (``scaffold_fn`` calling
``init_from_checkpoint``), added to show it.

Run it:
  python -m examples.efficientnet_tpu --model_dir=/tmp/effnet --train_steps=200
  python -m examples.efficientnet_tpu --mode=eval --model_dir=/tmp/effnet --train_steps=200
"""

from __future__ import annotations

import os

import flax.linen as nn  # changed: TF layers -> Flax
import jax  # changed: tf.nn -> jax
import jax.numpy as jnp  # changed: tf math -> jnp
import numpy as np
import optax  # changed: tf.train optimizers/decays -> optax
from absl import app, flags, logging

import estimator as estimator_lib  # changed: the local `est` keeps the reference's name free
import metrics  # changed: tf.metrics -> the host-side metrics package
from estimator import (
    rewriter_config_pb2,  # changed: namespace
    tpu,  # changed: tf.estimator.tpu -> estimator.tpu
)
from estimator import summary as tf2_summary  # changed: tf2.summary -> estimator.summary

flags.DEFINE_string("tpu", default=None, help="TPU name, or None for the local devices.")
flags.DEFINE_string("tpu_zone", default=None, help="[Optional] GCE zone (ignored here).")
flags.DEFINE_string("gcp_project", default=None, help="[Optional] GCP project (ignored here).")
flags.DEFINE_string("model_dir", None, "Estimator model_dir")
flags.DEFINE_string("mode", "train_and_eval", "One of {'train_and_eval', 'train', 'eval'}.")
flags.DEFINE_integer("train_steps", 200, "Total number of training steps.")
flags.DEFINE_integer("input_image_size", 8, "Input image size.")  # changed: digits are 8x8
flags.DEFINE_integer("train_batch_size", 64, "Global batch size for training.")
flags.DEFINE_integer("eval_batch_size", 64, "Global batch size for evaluation.")
flags.DEFINE_integer("num_train_images", 1297, "Size of training data set.")  # changed
flags.DEFINE_integer("num_eval_images", 300, "Size of evaluation data set.")  # changed
flags.DEFINE_integer("steps_per_eval", 100, "Steps between evaluations in train_and_eval.")
flags.DEFINE_integer("eval_timeout", None, "Seconds to wait for a new checkpoint in eval.")
flags.DEFINE_integer("iterations_per_loop", 10, "Steps per device loop.")
flags.DEFINE_integer("num_label_classes", 10, "Number of classes.")  # changed: digits
flags.DEFINE_float("base_learning_rate", 0.016, "Base learning rate at batch size 256.")
flags.DEFINE_float("weight_decay", 1e-5, "Weight decay coefficient for l2 regularization.")
flags.DEFINE_float("label_smoothing", 0.1, "Label smoothing parameter used in the softmax.")
flags.DEFINE_float("moving_average_decay", 0.9999, "Moving average decay rate.")
flags.DEFINE_bool("use_tpu", True, "Replicate over every device rather than use one.")
flags.DEFINE_bool("export_to_tpu", False, "Export a TPU SavedModel (TF-only; warned).")
flags.DEFINE_bool("skip_host_call", False, "Skip the host_call's summaries.")
flags.DEFINE_string("export_dir", None, "Where to export the model at the end.")
flags.DEFINE_bool("archive_ckpt", True, "Keep the best evaluation's model (see BestExporter).")
flags.DEFINE_string("init_checkpoint", None, "Warm start from this checkpoint.")  # added

FLAGS = flags.FLAGS


class MBConvBlock(nn.Module):  # changed: efficientnet_model.MBConvBlock as a Flax module
    """Expand (1x1), depthwise 3x3, squeeze-and-excitation, project (1x1), skip."""

    filters: int
    expand_ratio: int = 4
    training: bool = False

    @nn.compact
    def __call__(self, x):
        bn = dict(use_running_average=not self.training, momentum=0.99, epsilon=1e-3)
        # Named as Keras names them, so the reference's weight decay filter reads unchanged.
        names = iter(["batch_normalization", "batch_normalization_1", "batch_normalization_2"])
        inputs, channels = x, x.shape[-1] * self.expand_ratio
        x = nn.swish(nn.BatchNorm(name=next(names), **bn)(nn.Conv(channels, (1, 1))(x)))
        x = nn.Conv(channels, (3, 3), feature_group_count=channels)(x)  # depthwise
        x = nn.swish(nn.BatchNorm(name=next(names), **bn)(x))
        se = jnp.mean(x, axis=(1, 2), keepdims=True)
        se = nn.Conv(channels, (1, 1))(nn.swish(nn.Conv(max(1, channels // 16), (1, 1))(se)))
        x = x * jax.nn.sigmoid(se)
        x = nn.BatchNorm(name=next(names), **bn)(nn.Conv(self.filters, (1, 1))(x))
        return x + inputs if inputs.shape == x.shape else x


def build_model(images, training, num_classes):  # changed: efficientnet_builder in Flax
    bn = dict(use_running_average=not training, momentum=0.99, epsilon=1e-3)
    x = nn.Conv(16, (3, 3), name="stem_conv")(images)
    x = nn.swish(nn.BatchNorm(name="batch_normalization", **bn)(x))
    x = MBConvBlock(16, training=training, name="blocks_0")(x)
    x = MBConvBlock(24, training=training, name="blocks_1")(x)
    x = nn.swish(nn.BatchNorm(name="batch_normalization_1", **bn)(nn.Conv(64, (1, 1))(x)))
    return nn.Dense(num_classes, name="head_dense")(jnp.mean(x, axis=(1, 2))), None


def get_ema_vars():  # utils.get_ema_vars
    """Get all exponential moving average (ema) variables."""
    ema_vars = estimator_lib.trainable_variables() + estimator_lib.get_collection(  # changed: ns
        "moving_vars"
    )
    for v in estimator_lib.global_variables():  # changed: namespace
        # We maintain mva for batch norm moving mean and variance as well.
        if "moving_mean" in v.name or "moving_variance" in v.name:
            ema_vars.append(v)
    return list(set(ema_vars))


def build_learning_rate(
    initial_lr, global_step, steps_per_epoch, decay_factor=0.97, decay_epochs=2.4, warmup_epochs=5
):  # changed: utils' schedule
    decay_steps = steps_per_epoch * decay_epochs
    lr = initial_lr * decay_factor ** jnp.floor(global_step / decay_steps)  # staircase
    warmup_steps = steps_per_epoch * warmup_epochs
    warmup_lr = initial_lr * global_step / warmup_steps
    return jnp.where(global_step < warmup_steps, warmup_lr, lr)


def model_fn(features, labels, mode, params):
    """The model_fn for EfficientNet to be used with TPUEstimator."""
    if isinstance(features, dict):
        features = features["feature"]

    is_training = mode == estimator_lib.ModeKeys.TRAIN  # changed: namespace
    features = features / 16.0  # changed: digits pixels are 0..16 (no mean/std here)

    logits, _ = build_model(features, is_training, params["num_label_classes"])

    if mode == estimator_lib.ModeKeys.PREDICT:  # changed: namespace
        predictions = {
            "classes": jnp.argmax(logits, axis=1),  # changed: tf.argmax -> jnp
            "probabilities": jax.nn.softmax(logits),  # changed: tf.nn -> jax.nn
        }
        return estimator_lib.EstimatorSpec(  # changed: namespace
            mode=mode,
            predictions=predictions,
            export_outputs={
                "classify": estimator_lib.export.PredictOutput(predictions)  # changed: namespace
            },
        )

    one_hot_labels = jax.nn.one_hot(labels, FLAGS.num_label_classes)  # changed: tf -> jax
    cross_entropy = optax.softmax_cross_entropy(  # changed: tf.losses -> optax
        logits=logits,
        labels=optax.smooth_labels(one_hot_labels, FLAGS.label_smoothing),  # changed: optax
    ).mean()  # changed: optax returns per-example losses

    # Add weight decay to the loss for non-batch-normalization variables.
    loss = cross_entropy + FLAGS.weight_decay * sum(  # changed: tf.add_n -> sum
        [
            jnp.sum(v**2) / 2  # changed: tf.nn.l2_loss(v)
            for v in estimator_lib.trainable_variables()  # changed: namespace
            if "batch_normalization" not in v.name
        ]
    )

    global_step = estimator_lib.get_global_step()  # changed: namespace
    has_moving_average_decay = FLAGS.moving_average_decay > 0
    if has_moving_average_decay:
        ema = estimator_lib.ExponentialMovingAverage(  # changed: namespace
            decay=FLAGS.moving_average_decay, num_updates=global_step
        )
        ema_vars = get_ema_vars()

    host_call = None
    restore_vars_dict = None
    train_op = None
    if is_training:
        # Compute the current epoch and associated learning rate from global_step.
        current_epoch = global_step.astype(jnp.float32) / params["steps_per_epoch"]  # changed
        scaled_lr = FLAGS.base_learning_rate * (FLAGS.train_batch_size / 256.0)
        learning_rate = build_learning_rate(scaled_lr, global_step, params["steps_per_epoch"])
        optimizer = optax.rmsprop(  # changed: utils.build_optimizer's RMSProp in optax
            lambda step: build_learning_rate(scaled_lr, step, params["steps_per_epoch"]),
            decay=0.9,
            momentum=0.9,
            eps=1e-3,
        )
        if FLAGS.use_tpu:
            optimizer = estimator_lib.CrossShardOptimizer(optimizer)  # changed: namespace

        # Batch normalization requires UPDATE_OPS to be added as a dependency to
        # the train operation.
        update_ops = estimator_lib.get_collection(  # changed: namespace
            estimator_lib.GraphKeys.UPDATE_OPS
        )
        with estimator_lib.control_dependencies(update_ops):  # changed: namespace
            train_op = optimizer  # changed: minimize -> optax: the estimator differentiates loss

        if has_moving_average_decay:
            with estimator_lib.control_dependencies([train_op]):  # changed: namespace
                train_op = ema.apply(ema_vars)

        if not FLAGS.skip_host_call:

            def host_call_fn(gs, lr, ce):
                gs = gs[0]
                with tf2_summary.create_file_writer(
                    FLAGS.model_dir, max_queue=FLAGS.iterations_per_loop
                ).as_default():
                    with tf2_summary.record_if(True):
                        tf2_summary.scalar("learning_rate", lr[0], step=gs)
                        tf2_summary.scalar("current_epoch", ce[0], step=gs)
                        return tf2_summary.all_v2_summary_ops()

            gs_t = jnp.reshape(global_step, [1])  # changed: tf.reshape -> jnp
            lr_t = jnp.reshape(learning_rate, [1])  # changed: tf.reshape -> jnp
            ce_t = jnp.reshape(current_epoch, [1])  # changed: tf.reshape -> jnp
            host_call = (host_call_fn, [gs_t, lr_t, ce_t])
    else:
        train_op = None
        if has_moving_average_decay:
            # Load moving average variables for eval.
            restore_vars_dict = ema.variables_to_restore(ema_vars)

    eval_metrics = None
    if mode == estimator_lib.ModeKeys.EVAL:  # changed: namespace

        def metric_fn(labels, logits):
            predictions = np.argmax(logits, axis=1)  # changed: tf.argmax -> numpy (host)
            top_1_accuracy = metrics.accuracy(labels, predictions)  # changed: package
            in_top_5 = (np.argsort(-logits, 1)[:, :5] == labels[:, None]).any(1)  # changed
            top_5_accuracy = metrics.mean(in_top_5.astype(np.float32))  # changed: package
            return {"top_1_accuracy": top_1_accuracy, "top_5_accuracy": top_5_accuracy}

        eval_metrics = (metric_fn, [labels, logits])

    def _scaffold_fn():
        saver = estimator_lib.Saver(restore_vars_dict)  # changed: namespace
        return estimator_lib.Scaffold(saver=saver)  # changed: namespace

    if has_moving_average_decay and not is_training:
        # Only apply scaffold for eval jobs.
        scaffold_fn = _scaffold_fn
    else:
        scaffold_fn = None

    if FLAGS.init_checkpoint and is_training:  # added: BERT's TPU warm start (run_classifier)

        def tpu_scaffold():
            estimator_lib.init_from_checkpoint(FLAGS.init_checkpoint, {"/": "/"})
            return estimator_lib.Scaffold()

        scaffold_fn = tpu_scaffold

    return tpu.TPUEstimatorSpec(  # changed: namespace
        mode=mode,
        loss=loss,
        train_op=train_op,
        host_call=host_call,
        eval_metrics=eval_metrics,
        scaffold_fn=scaffold_fn,
    )


_SPLITS = {"train": slice(0, 1297), "validation": slice(1297, 1597)}


def dataset(split):  # changed: imagenet_input's TFRecords -> the digits shipped locally
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.float32)[..., None]
    return images[_SPLITS[split]], digits.target.astype(np.int32)[_SPLITS[split]]


def train_input_fn(params):  # changed: imagenet_train.input_fn in numpy
    batch_size = params["batch_size"]
    images, labels = dataset("train")
    rng = np.random.RandomState(0)
    while True:
        order = rng.permutation(len(images))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield {"feature": images[order[i : i + batch_size]]}, labels[order[i : i + batch_size]]


def eval_input_fn(params):  # changed: imagenet_eval.input_fn in numpy
    batch_size = params["batch_size"]
    images, labels = dataset("validation")
    for i in range(0, len(images) - batch_size + 1, batch_size):
        yield {"feature": images[i : i + batch_size]}, labels[i : i + batch_size]


def build_image_serving_input_fn(image_size, batch_size=None):
    def _image_serving_input_fn():
        # changed: TF decoded image bytes in the graph; the served input is the image batch
        images = jax.ShapeDtypeStruct((batch_size or 1, image_size, image_size, 1), jnp.float32)
        return estimator_lib.export.ServingInputReceiver(  # changed: namespace
            images, {"image_bytes": images}
        )

    return _image_serving_input_fn


def export(est, export_dir, input_image_size=None):
    if not input_image_size:
        input_image_size = FLAGS.input_image_size
    logging.info("Starting to export model.")
    image_serving_input_fn = build_image_serving_input_fn(input_image_size)
    return est.export_saved_model(  # changed: returned for the caller
        export_dir_base=export_dir, serving_input_receiver_fn=image_serving_input_fn
    )


def higher_top_1(best_eval_result, current_eval_result):  # changed: archive_ckpt's rule
    return current_eval_result["top_1_accuracy"] > best_eval_result["top_1_accuracy"]


def main(unused_argv):
    tpu_cluster_resolver = estimator_lib.TPUClusterResolver(  # changed: package name
        FLAGS.tpu if (FLAGS.tpu or FLAGS.use_tpu) else "",
        zone=FLAGS.tpu_zone,
        project=FLAGS.gcp_project,
    )
    save_checkpoints_steps = max(10, FLAGS.iterations_per_loop)  # changed: 100 in the reference
    config = tpu.RunConfig(  # changed: namespace
        cluster=tpu_cluster_resolver,
        model_dir=FLAGS.model_dir,
        save_checkpoints_steps=save_checkpoints_steps,
        log_step_count_steps=FLAGS.iterations_per_loop,
        session_config=estimator_lib.ConfigProto(  # changed: namespace (ignored, warned)
            graph_options=estimator_lib.GraphOptions(  # changed: namespace
                rewrite_options=rewriter_config_pb2.RewriterConfig(disable_meta_optimizer=True)
            )
        ),
        tpu_config=tpu.TPUConfig(  # changed: namespace
            iterations_per_loop=FLAGS.iterations_per_loop,
            per_host_input_for_training=tpu.InputPipelineConfig.PER_HOST_V2,  # changed: ns
        ),
    )
    params = dict(
        steps_per_epoch=FLAGS.num_train_images / FLAGS.train_batch_size,
        num_label_classes=FLAGS.num_label_classes,
    )
    est = tpu.TPUEstimator(  # changed: namespace
        use_tpu=FLAGS.use_tpu,
        model_fn=model_fn,
        config=config,
        train_batch_size=FLAGS.train_batch_size,
        eval_batch_size=FLAGS.eval_batch_size,
        export_to_tpu=FLAGS.export_to_tpu,
        params=params,
    )
    # changed: utils.archive_ckpt(eval_results, top_1_accuracy, ckpt) -> a BestExporter
    best_exporter = estimator_lib.BestExporter(
        name="best",
        serving_input_receiver_fn=build_image_serving_input_fn(FLAGS.input_image_size),
        event_file_pattern="eval/*.tfevents.*",
        compare_fn=higher_top_1,
        exports_to_keep=1,
    )
    eval_steps = FLAGS.num_eval_images // FLAGS.eval_batch_size
    eval_results = None  # changed: kept for the caller

    if FLAGS.mode == "eval":
        # Run evaluation when there's a new checkpoint
        for ckpt in estimator_lib.checkpoints_iterator(  # changed: namespace
            FLAGS.model_dir, timeout=FLAGS.eval_timeout
        ):
            logging.info("Starting to evaluate.")
            try:
                eval_results = est.evaluate(
                    input_fn=eval_input_fn, steps=eval_steps, checkpoint_path=ckpt
                )
                logging.info("Eval results: %s", eval_results)
                if FLAGS.archive_ckpt:
                    best_exporter.export(  # changed: was utils.archive_ckpt(...)
                        est,
                        os.path.join(FLAGS.model_dir, "export", "best"),
                        ckpt,
                        eval_results,
                        False,
                    )
                # Terminate eval job when final checkpoint is reached
                current_step = int(os.path.basename(ckpt).split("-")[1])
                if current_step >= FLAGS.train_steps:
                    logging.info("Evaluation finished after training step %d", current_step)
                    break
            except estimator_lib.errors.NotFoundError:  # changed: namespace
                logging.info("Checkpoint %s no longer exists, skipping checkpoint", ckpt)
    else:  # FLAGS.mode == 'train' or FLAGS.mode == 'train_and_eval'
        current_step = estimator_lib._load_global_step_from_checkpoint_dir(  # changed: ns
            FLAGS.model_dir
        )
        if FLAGS.mode == "train":
            est.train(input_fn=train_input_fn, max_steps=FLAGS.train_steps)
        else:
            assert FLAGS.mode == "train_and_eval"
            while current_step < FLAGS.train_steps:
                # Train for up to steps_per_eval number of steps.
                # At the end of training, a checkpoint will be written to --model_dir.
                next_checkpoint = min(current_step + FLAGS.steps_per_eval, FLAGS.train_steps)
                est.train(input_fn=train_input_fn, max_steps=next_checkpoint)
                current_step = next_checkpoint
                logging.info("Starting to evaluate.")
                eval_results = est.evaluate(input_fn=eval_input_fn, steps=eval_steps)
                logging.info("Eval results at step %d: %s", next_checkpoint, eval_results)
                if FLAGS.archive_ckpt:  # added: the best export, as in eval mode
                    best_exporter.export(
                        est,
                        os.path.join(FLAGS.model_dir, "export", "best"),
                        est.latest_checkpoint(),
                        eval_results,
                        False,
                    )

    exported = None  # changed: kept for the caller
    if FLAGS.export_dir:
        exported = export(est, FLAGS.export_dir, FLAGS.input_image_size)
    return est, eval_results, exported  # changed: returned for the caller


if __name__ == "__main__":
    app.run(main)
