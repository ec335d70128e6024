"""The model zoo's registry entries, to merge into ``models.MODELS`` / ``models.DATASETS``.

``estimator.jobs.build`` looks a config's ``model`` and ``dataset`` up in those registries.

Example:
  >>> from models import zoo
  >>> sorted(zoo.ZOO_MODELS)
  ['cnn', 'resnet', 'transformer_lm']
"""

from __future__ import annotations

from collections.abc import Callable

from . import cnn, resnet, text, transformer

ZOO_MODELS: dict[str, Callable] = {
    "cnn": cnn.model_fn,
    "resnet": resnet.model_fn,
    "transformer_lm": transformer.model_fn,
}

ZOO_DATASETS: dict[str, Callable] = {"text": text.char_lm}
