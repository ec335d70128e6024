"""What model_fn's variables become: initialisation from checkpoints and warm start
(``scaffold``), TF-style variable listings (``trainable``) and moving-average weights
(``moving_average``). Above ``io`` (it reads checkpoints), below ``driver``.
"""
