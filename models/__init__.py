"""Reusable Flax modules and ready model_fns for the estimator.

``MODELS`` and ``DATASETS`` are the registries a config's ``model`` and ``dataset`` name.
"""

from . import text
from .cnn import CNN
from .cnn import model_fn as cnn_model_fn
from .datasets import DATASETS, digits, synthetic_images
from .mlp import MLP, classifier_model_fn, masked_cross_entropy
from .mlp import model_fn as mlp_model_fn
from .resnet import STAGES, ResNet
from .resnet import model_fn as resnet_model_fn
from .transformer import Perplexity, TransformerLM
from .transformer import model_fn as transformer_lm_model_fn
from .zoo import ZOO_DATASETS, ZOO_MODELS

MODELS = {"mlp": mlp_model_fn, **ZOO_MODELS}
DATASETS.update(ZOO_DATASETS)

__all__ = [
    "CNN",
    "DATASETS",
    "MLP",
    "MODELS",
    "STAGES",
    "Perplexity",
    "ResNet",
    "TransformerLM",
    "classifier_model_fn",
    "cnn_model_fn",
    "digits",
    "masked_cross_entropy",
    "mlp_model_fn",
    "resnet_model_fn",
    "synthetic_images",
    "text",
    "transformer_lm_model_fn",
]
