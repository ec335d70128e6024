"""Jobs from configs: a ConfigDict names a model and a data set; this builds the estimator.

Configs are Python files with ``get_config()`` (see ``configs/``); ``--config.key=value``
overrides are parsed as Python literals and type-checked by the ConfigDict.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
from typing import Any

import ml_collections

import models

from ..cluster.cluster import from_environment
from ..config import RunConfig, TPUConfig
from ..data.inputs import call_input_fn, split_element
from ..input_context import InputContext
from ..io import export as export_lib
from ..spec import ModeKeys
from ..tpu_estimator import TPUEstimator

DEFAULT_CONFIG = "configs/digits_mlp.py"


def load_config(path: str | None = None) -> ml_collections.ConfigDict:
    """``get_config()`` of a config file, or of the packaged ``configs`` module of that name."""
    path = path or DEFAULT_CONFIG
    if os.path.exists(path):
        spec = importlib.util.spec_from_file_location(
            "_job_config_" + os.path.basename(path)[:-3], path
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        name = os.path.splitext(os.path.basename(path))[0]
        try:
            module = importlib.import_module(f"configs.{name}")
        except ModuleNotFoundError:
            raise FileNotFoundError(f"--config {path!r}: no such file or packaged config") from None
    return module.get_config()


def _parse(value: str) -> Any:
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict[str, str]) -> None:
    """Sets ``a.b=value`` entries, naming the key on a type or name error."""
    for key, raw in overrides.items():
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node[p]
        if leaf not in node:
            raise KeyError(f"--config.{key}: {leaf!r} is not a field of the config")
        value = _parse(raw)
        current = node[leaf]
        if isinstance(current, float) and isinstance(value, int):
            value = float(value)
        if isinstance(current, tuple) and isinstance(value, (list, int)):
            value = tuple(value) if isinstance(value, list) else (value,)
        try:
            node[leaf] = value
        except TypeError as e:
            raise TypeError(f"--config.{key}={raw!r}: {e}") from None


def _cache_setting(value):
    """A config's ``compilation_cache_dir``: ``""``/None the default cache, False off, or a
    path (``--config.compilation_cache_dir=False`` arrives as the bool)."""
    return None if value == "" else value


def run_config(config: ml_collections.ConfigDict, model_dir: str | None) -> RunConfig:
    return RunConfig(
        model_dir=model_dir,
        tpu_config=TPUConfig(
            iterations_per_loop=config.iterations_per_loop,
            num_cores_per_replica=config.get("num_cores_per_replica", 1) or None,
            host_call_every_n_steps=config.get("host_call_every_n_steps", 1),
            unroll_loops=config.get("unroll_loops", False),
            shard_optimizer_state=config.get("shard_optimizer_state", False),
            shard_params=config.get("shard_params", False),
        ),
        save_checkpoints_steps=config.save_checkpoints_steps,
        keep_checkpoint_max=config.get("keep_checkpoint_max", 5),
        save_summary_steps=config.get("save_summary_steps", 100),
        log_step_count_steps=config.get("log_step_count_steps", 100),
        tf_random_seed=config.get("seed", 0),
        compilation_cache_dir=_cache_setting(config.get("compilation_cache_dir", None)),
        cluster=from_environment(),  # TF_CONFIG or a TPU pod / Slurm job: join it
    )


def build(config: ml_collections.ConfigDict, model_dir: str | None) -> tuple[TPUEstimator, dict]:
    """The estimator and the ``{"train", "eval", "predict"}`` input_fns of a job config."""
    if config.model not in models.MODELS:
        raise KeyError(f"config.model={config.model!r}; known models: {sorted(models.MODELS)}")
    if config.dataset not in models.DATASETS:
        raise KeyError(f"config.dataset={config.dataset!r}; known: {sorted(models.DATASETS)}")
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
