"""ResNet-50 on synthetic ImageNet-sized data (224x224x3, 1000 classes): a throughput benchmark.

Run: ``tpu-estimator --config configs/resnet50_imagenet_synthetic.py --model_dir /tmp/r50``.

A variant of ``resnet18_cifar_synthetic``: bottleneck blocks, the 7x7/stride-2 ImageNet stem,
1000 classes. The data is random, so accuracy is chance (0.1%); the job measures throughput.
A small pool of distinct images is cycled (224x224x3 float32 images take 602 KB each).
On TPU/GPU use ``--config.model_params.dtype=bfloat16 --config.train_batch_size=1024
--config.iterations_per_loop=100``.
"""

import ml_collections

from configs import resnet18_cifar_synthetic


def get_config() -> ml_collections.ConfigDict:
    c = resnet18_cifar_synthetic.get_config()
    c.image_size = (224, 224, 3)
    c.num_classes = 1000
    c.num_train_examples = 256
    c.num_eval_examples = 64
    c.model_params.depth = 50
    c.model_params.stem = "imagenet"
    c.model_params.num_classes = 1000
    c.train_batch_size = 32
    c.eval_batch_size = 32
    c.predict_batch_size = 32
    c.max_steps = 20
    c.model_params.decay_steps = 20
    c.save_checkpoints_steps = 20
    c.log_step_count_steps = 5
    return c
