"""Driving config files the way the CLI does: load_config + apply_overrides + build."""

from __future__ import annotations

import os

import jax
import pytest

import models
from estimator.cli import jobs
from models import zoo as zoo_lib

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def config_names() -> list[str]:
    """Every job config in configs/ (each file with get_config())."""
    return sorted(
        f[:-3] for f in os.listdir(CONFIG_DIR) if f.endswith(".py") and not f.startswith("_")
    )


@pytest.fixture(autouse=True)
def zoo(monkeypatch):
    """The zoo's models and data sets in the registries jobs.build reads."""
    for name, fn in zoo_lib.ZOO_MODELS.items():
        monkeypatch.setitem(models.MODELS, name, fn)
    for name, fn in zoo_lib.ZOO_DATASETS.items():
        monkeypatch.setitem(models.DATASETS, name, fn)


@pytest.fixture
def fast_compile():
    """XLA with most optimizations off: compile-bound tests of big models run far faster."""
    before = bool(jax.config.values.get("jax_disable_most_optimizations", False))
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


def build_job(name: str, model_dir, **overrides):
    """(estimator, input_fns, config) of ``configs/<name>.py`` with ``--config.k=v`` overrides."""
    config = jobs.load_config(os.path.join(CONFIG_DIR, f"{name}.py"))
    jobs.apply_overrides(config, {k: repr(v) for k, v in overrides.items()})
    est, input_fns = jobs.build(config, str(model_dir))
    return est, input_fns, config


def count_examples(input_fn, batch_size: int) -> int:
    """Rows an eval/predict input_fn yields, counted straight from the input_fn."""
    total = 0
    for batch in input_fn({"batch_size": batch_size}):
        features = batch[0] if isinstance(batch, tuple) else batch
        total += len(jax.tree.leaves(features)[0])
    return total
