"""A shrunken default job for tests and quick checks: few steps, small layers."""

from configs import digits_mlp


def get_config():
    c = digits_mlp.get_config()
    c.model_params.hidden = (64,)
    c.max_steps = 40
    c.iterations_per_loop = 10
    c.save_checkpoints_steps = 20
    c.model_params.decay_steps = 40
    return c
