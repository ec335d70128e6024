"""Reusable Flax modules and ready model_fns for the estimator."""

from .datasets import DATASETS, digits, synthetic_images
from .mlp import MLP, classifier_model_fn, masked_cross_entropy
from .mlp import model_fn as mlp_model_fn

MODELS = {"mlp": mlp_model_fn}

__all__ = [
    "DATASETS",
    "MLP",
    "MODELS",
    "classifier_model_fn",
    "digits",
    "masked_cross_entropy",
    "mlp_model_fn",
    "synthetic_images",
]
