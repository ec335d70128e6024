"""A decoder-only Transformer language model on Python's own reference text, byte level.

Run: ``tpu-estimator --config configs/transformer_lm.py --model_dir /tmp/lm``. Eval results
include ``perplexity`` (exp of the mean per-token loss) and next-byte ``accuracy``.

The text is the Python language reference that ships with CPython (``pydoc_data``); see
``models/text.py`` for the other sources (``--config.text_source=zen`` or a file path).
Change the size with ``--config.model_params.num_layers=6 --config.model_params.d_model=256``.
"""

import ml_collections

from configs import digits_mlp


def get_config() -> ml_collections.ConfigDict:
    c = digits_mlp.get_config()
    c.model = "transformer_lm"
    c.dataset = "text"
    c.text_source = "python_reference"
    c.seq_len = 128
    c.eval_fraction = 0.1
    c.model_params = ml_collections.ConfigDict(
        {
            "num_layers": 3,
            "num_heads": 4,
            "d_model": 128,
            "mlp_dim": 512,
            "max_len": 128,
            "dropout": 0.0,
            "dtype": "float32",
            "learning_rate": 2e-3,
            "warmup_steps": 100,
            "decay_steps": 1000,
            "weight_decay": 0.01,
            "grad_clip": 1.0,
            "moving_average_decay": 0.0,  # e.g. 0.999: evaluate averaged weights
            "write_summaries": True,
        }
    )
    c.train_batch_size = 32
    c.eval_batch_size = 64
    c.predict_batch_size = 64
    c.max_steps = 1000
    c.iterations_per_loop = 50
    c.shard_optimizer_state = False  # docs/sharding.md
    c.shard_params = False
    c.save_checkpoints_steps = 500
    c.target_metric = "perplexity"
    return c
