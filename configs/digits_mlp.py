"""The default job: an MLP on scikit-learn's bundled digits, 8 replicas.

Run: ``tpu-estimator`` (no arguments), or
``tpu-estimator train_and_evaluate --config configs/digits_mlp.py --model_dir /tmp/mlp``.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "mlp"
    c.dataset = "digits"
    c.image = False
    c.model_params = ml_collections.ConfigDict(
        {
            "hidden": (256, 128),
            "num_classes": 10,
            "dropout": 0.1,
            "learning_rate": 3e-3,
            "weight_decay": 1e-4,
            "decay_steps": 600,
            "moving_average_decay": 0.0,  # e.g. 0.999: evaluate averaged weights
            "write_summaries": True,
        }
    )
    c.use_tpu = True
    c.train_batch_size = 128
    c.eval_batch_size = 128
    c.predict_batch_size = 128
    c.max_steps = 600
    c.eval_steps = 0  # 0: the whole eval set
    c.iterations_per_loop = 100
    c.unroll_loops = False
    c.num_cores_per_replica = 1
    c.shard_optimizer_state = False  # docs/sharding.md
    c.shard_params = False
    c.save_checkpoints_steps = 200
    c.keep_checkpoint_max = 3
    c.save_summary_steps = 50
    c.log_step_count_steps = 100
    c.host_call_every_n_steps = 10
    c.seed = 0
    c.throttle_secs = 0
    c.target_metric = "accuracy"
    return c
