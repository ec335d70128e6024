"""ResNet-18 on synthetic CIFAR-10-sized data (32x32x3, 10 classes): a throughput benchmark.

Run: ``tpu-estimator --config configs/resnet18_cifar_synthetic.py --model_dir /tmp/r18``.

The images and labels are random (``models.datasets.synthetic_images``), so eval accuracy is
chance (about 10%) by construction; the job measures examples per second (the
``global_step/sec`` summary and the step logs). BatchNorm statistics are cross-replica
(``model_params.cross_replica_bn``). XLA:CPU runs convolutions inside a rolled loop far more
slowly (jax-ml/jax#12868), so the loop is one step and ``unroll_loops=None`` unrolls the
training loop on CPU; on TPU/GPU use ``--config.iterations_per_loop=100`` (left rolled).
"""

import ml_collections

from configs import digits_mlp


def get_config() -> ml_collections.ConfigDict:
    c = digits_mlp.get_config()
    c.model = "resnet"
    c.dataset = "synthetic_images"
    c.image_size = (32, 32, 3)
    c.num_classes = 10
    c.num_train_examples = 1024
    c.num_eval_examples = 256
    c.model_params = ml_collections.ConfigDict(
        {
            "depth": 18,
            "stage_sizes": None,  # None: the depth's; e.g. (1, 1, 1, 1) for a quick test
            "stem": "cifar",
            "num_filters": 64,
            "num_classes": 10,
            "cross_replica_bn": True,
            "bn_momentum": 0.9,
            "dtype": "float32",
            "optimizer": "momentum",
            "learning_rate": 0.1,
            "warmup_steps": 5,
            "decay_steps": 100,
            "weight_decay": 5e-4,
            "moving_average_decay": 0.0,  # e.g. 0.999: evaluate averaged weights
            "write_summaries": True,
        }
    )
    c.train_batch_size = 128
    c.eval_batch_size = 128
    c.predict_batch_size = 128
    c.max_steps = 100
    c.iterations_per_loop = 1
    c.unroll_loops = None  # training unrolled on CPU (loops of <= 10 steps), else rolled
    c.save_checkpoints_steps = 100
    c.log_step_count_steps = 10
    c.host_call_every_n_steps = 1
    return c
