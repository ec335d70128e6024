"""A small CNN on the bundled digits as 8x8x1 images, 8 replicas.

Run: ``tpu-estimator --config configs/digits_cnn.py --model_dir /tmp/cnn``.

XLA:CPU runs the gradient convolutions of a rolled ``lax.scan`` far slower (jax-ml/jax#12868),
so the device loop is short (``iterations_per_loop=10``) and ``unroll_loops=None`` unrolls the
training loop on CPU (evaluation stays rolled; everything is rolled on TPU/GPU, where
``--config.iterations_per_loop=100`` is better).
"""

import ml_collections

from configs import digits_mlp


def get_config() -> ml_collections.ConfigDict:
    c = digits_mlp.get_config()
    c.model = "cnn"
    c.image = True
    c.model_params = ml_collections.ConfigDict(
        {
            "features": (32, 64),
            "dense": 128,
            "num_classes": 10,
            "dropout": 0.1,
            "learning_rate": 3e-3,
            "weight_decay": 1e-4,
            "decay_steps": 600,
            "moving_average_decay": 0.0,  # e.g. 0.999: evaluate averaged weights
            "write_summaries": True,
        }
    )
    c.iterations_per_loop = 10
    c.unroll_loops = None  # training unrolled on CPU (loops of <= 10 steps), else rolled
    return c
