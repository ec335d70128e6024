"""Jobs from configs: the estimator and input_fns a config names (this imports JAX).

``configs`` reads and checks config files without JAX; this module turns a checked config
into a ``TPUEstimator`` (``build``), leaving every field the config does not set to
``RunConfig``'s and ``TPUConfig``'s own defaults.
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections

import models

from ..cluster.cluster import from_environment
from ..core.config import RunConfig, TPUConfig
from ..core.input_context import InputContext
from ..core.spec import ModeKeys
from ..data.inputs import call_input_fn, split_element
from ..io import export as export_lib
from ..tpu_estimator import TPUEstimator
from .checks import RUN_CONFIG_FIELDS, TPU_CONFIG_FIELDS, given_fields
from .configs import DEFAULT_CONFIG, apply_overrides, load_config
from .usage import UsageError, did_you_mean

__all__ = [
    "DEFAULT_CONFIG",
    "apply_overrides",
    "build",
    "export_from_config",
    "global_step",
    "load_config",
    "run_config",
]


def run_config(config: ml_collections.ConfigDict, model_dir: str | None) -> RunConfig:
    """The RunConfig of a job config (joining a cluster when TF_CONFIG or a pod says so)."""
    return RunConfig(
        model_dir=model_dir,
        tpu_config=TPUConfig(**given_fields(config, TPU_CONFIG_FIELDS)),
        cluster=from_environment(),
        **given_fields(config, RUN_CONFIG_FIELDS),
    )


def build(config: ml_collections.ConfigDict, model_dir: str | None) -> tuple[TPUEstimator, dict]:
    """The estimator and the ``{"train", "eval", "predict"}`` input_fns of a job config."""
    for field, known in (("model", models.MODELS), ("dataset", models.DATASETS)):
        if config[field] not in known:
            raise UsageError(
                f"--config.{field}={config[field]}: no such {field}"
                + did_you_mean(config[field], known)
                + f"; known: {', '.join(sorted(known))}"
            )
    est = TPUEstimator(
        models.MODELS[config.model],
        config=run_config(config, model_dir),
        params=config.model_params.to_dict(),
        use_tpu=config.use_tpu,
        train_batch_size=config.train_batch_size,
        eval_batch_size=config.eval_batch_size,
        predict_batch_size=config.predict_batch_size,
    )
    return est, models.DATASETS[config.dataset](config)


def global_step(est: TPUEstimator) -> int | None:
    """The step of the newest checkpoint in the estimator's model_dir (None: none yet)."""
    path = est.latest_checkpoint()
    return None if path is None else int(os.path.normpath(path).rsplit("-", 1)[-1])


def export_from_config(est, config: Any, export_dir_base: str) -> str:
    """``tpu-estimator export``: serving shapes from the first batch of the job's predict input.

    ``config.export_fold_variables`` (optional, default False) chooses folded variables.
    """
    input_fn = models.DATASETS[config.dataset](config)["predict"]
    batch = config.get("predict_batch_size", None) or config.eval_batch_size
    it = call_input_fn(
        input_fn,
        params={"batch_size": int(batch)},
        config=est.config,
        mode=ModeKeys.PREDICT,
        input_context=InputContext(1, 0, 1),
    )
    features, _ = split_element(next(iter(it)))
    fn = export_lib.build_raw_serving_input_receiver_fn(features)
    return est.export_saved_model(
        export_dir_base, fn, fold_variables=bool(config.get("export_fold_variables", False))
    )
