"""TPUEstimator: one model_fn, compiled train/eval/predict loops on every device.

Example:
  >>> est = estimator.TPUEstimator(model_fn, model_dir="/tmp/mlp", train_batch_size=128,
  ...                              eval_batch_size=128, params={"hidden": 256},
  ...                              config=estimator.RunConfig(save_checkpoints_steps=100))
  >>> est.train(train_input_fn, max_steps=1000)
  >>> est.evaluate(eval_input_fn)        # {'accuracy': 0.97, 'loss': 0.1, 'global_step': 1000}
  >>> next(est.predict(predict_input_fn))

Current limitations are listed in docs/design.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from hooks.base import as_hook_list

from .cluster.cluster import start_cluster
from .core import runtime
from .core.config import RunConfig, TPUConfig
from .core.errors import EstimatorTypeError, EstimatorValueError, NoCheckpointError
from .core.spec import ModeKeys
from .data.feeder import Feeder
from .data.layout import batch_layouts
from .driver.evaluation import run_eval_loops
from .driver.export import export_saved_model
from .driver.job import Job, TrainOutcome
from .driver.prediction import checked_predict_keys, run_predict_loops
from .driver.training import check_steps, run_train_loops
from .engine.model import ModelFn, user_params
from .engine.programs import Programs
from .io import step_names
from .io.checkpoint_read import read_variables
from .io.checkpoint_utils import load_variable
from .io.model_dir import resolve_model_dir
from .io.store import StateStore
from .parallel import multihost
from .parallel.mesh import make_mesh, num_replicas, single_device_mesh
from .tf_only import tf_only_arguments

log = logging.getLogger("estimator")


class TPUEstimator:
    """TF's ``tf.estimator.tpu.TPUEstimator`` on JAX.

    Args:
      model_fn: ``model_fn(features, labels, mode, params[, config])`` returning a
        ``TPUEstimatorSpec``; it builds the model for one replica.
      model_dir: checkpoints and summaries; must equal ``config.model_dir`` when both are set.
      config: a ``RunConfig``.
      params: hyperparameters, deep-copied; ``batch_size`` and ``context`` are reserved, and
        model_fn also finds ``use_tpu`` there (as in TF).
      use_tpu: ``True`` replicates over every device; ``False`` runs one device on the global
        batch (same code path).
      train_batch_size, eval_batch_size, predict_batch_size: global batch sizes.
      warm_start_from: a checkpoint path or ``WarmStartSettings`` applied on a fresh start.
      batch_axis, eval_on_tpu, export_to_tpu, export_to_cpu, export_saved_model_api_version:
        TF's, keyword-only, accepted with one warning each (see ``tf_only.tf_only_arguments``).
      embedding_config_spec: TF's TPU embedding; only None (the TPU embedding engine has no
        counterpart: build the tables as ``flax.linen.Embed`` in model_fn).
    """

    def __init__(
        self,
        model_fn: Callable,
        model_dir: str | None = None,
        config: RunConfig | None = None,
        params: dict | None = None,
        use_tpu: bool = True,
        train_batch_size: int | None = None,
        eval_batch_size: int | None = None,
        predict_batch_size: int | None = None,
        warm_start_from: Any = None,
        *,
        batch_axis: Any = None,
        eval_on_tpu: bool | None = None,
        export_to_tpu: bool | None = None,
        export_to_cpu: bool | None = None,
        embedding_config_spec: Any = None,
        export_saved_model_api_version: Any = None,
    ):
        tf_only_arguments(
            batch_axis=batch_axis,
            eval_on_tpu=eval_on_tpu,
            export_to_tpu=export_to_tpu,
            export_to_cpu=export_to_cpu,
            embedding_config_spec=embedding_config_spec,
            export_saved_model_api_version=export_saved_model_api_version,
        )
        if not callable(model_fn):
            raise EstimatorTypeError(f"model_fn must be callable, got {type(model_fn).__name__}")
        config = config if config is not None else RunConfig()
        if not isinstance(config, RunConfig):
            raise EstimatorTypeError(
                f"config must be an estimator.RunConfig, got {type(config).__name__}"
            )
        start_cluster(  # before devices
            config.cluster,
            model_dir=model_dir or config.model_dir,
            latest_checkpoint=step_names.newest_finished_path,
        )
        self._config = config.replace(model_dir=resolve_model_dir(model_dir, config.model_dir))
        runtime.setup(self._config)
        self._params = user_params(params)
        self._model = ModelFn(model_fn, self._params, self._config)
        self._use_tpu = bool(use_tpu)
        tpu = self._config.tpu_config
        self._mesh = _device_mesh(self._use_tpu, tpu)
        self._replicas = num_replicas(self._mesh)
        self._model.num_replicas = self._replicas
        self._model.num_cores_per_replica = self._mesh.shape["model"]
        self._model.use_tpu = self._use_tpu
        sizes = {
            ModeKeys.TRAIN: train_batch_size,
            ModeKeys.EVAL: eval_batch_size,
            ModeKeys.PREDICT: predict_batch_size,
        }
        layouts = batch_layouts(
            sizes,
            replicas=self._replicas,
            local_replicas=multihost.local_replicas(self._mesh),
            pipeline=tpu.per_host_input_for_training,
            use_tpu=self._use_tpu,
        )
        self._warm_start_from = warm_start_from
        self._job = Job(
            config=self._config,
            mesh=self._mesh,
            model=self._model,
            programs=Programs(self._model, self._mesh, self._config),
            store=StateStore(self.model_dir, keep_checkpoint_max=self._config.keep_checkpoint_max),
            feeder=Feeder(layouts, self._params, self._config, self._mesh),
        )
        self._last_outcome: TrainOutcome | None = None

    # ----------------------------------------------------------------- properties
    @property
    def model_dir(self) -> str:
        return self._config.model_dir

    @property
    def config(self) -> RunConfig:
        return self._config

    @property
    def params(self) -> dict:
        return dict(self._params)

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._mesh

    @property
    def num_replicas(self) -> int:
        return self._replicas

    def eval_dir(self, name: str | None = None) -> str:
        return self._job.eval_dir(name)

    # ----------------------------------------------------------------- train
    def train(
        self,
        input_fn: Callable,
        hooks: Sequence | None = None,
        steps: int | None = None,
        max_steps: int | None = None,
        saving_listeners: Sequence | None = None,
    ) -> TPUEstimator:
        """Trains until ``steps`` more steps, ``max_steps`` in all, or the end of the input.

        Resumes from the latest checkpoint in ``model_dir``; returns when every host call,
        hook and checkpoint write has finished. ``saving_listeners``
        (``hooks.CheckpointSaverListener``) are called around each checkpoint it writes.

        Raises:
          ValueError: ``steps``/``max_steps`` both set or not positive.
          NanLossDuringTrainingError: a NaN or Inf loss (no checkpoint of it is written).
        """
        check_steps(steps, max_steps)
        hooks = as_hook_list(hooks)
        self._last_outcome = run_train_loops(
            self._job,
            input_fn,
            hooks=hooks,
            steps=steps,
            max_steps=max_steps,
            warm_start_from=self._warm_start_from,
            saving_listeners=saving_listeners,
        )
        return self

    @property
    def last_train_outcome(self) -> TrainOutcome | None:
        """How the last ``train`` call ended: ``step`` and ``reason`` (an ``EndReason``:
        ``"target"``, ``"hook"``, ``"listener"``, ``"input_end"``, ``"already_done"``), or
        None before one returned."""
        return self._last_outcome

    # ----------------------------------------------------------------- evaluate / predict
    def evaluate(
        self,
        input_fn: Callable,
        steps: int | None = None,
        hooks: Sequence | None = None,
        checkpoint_path: str | None = None,
        name: str | None = None,
    ) -> dict:
        """Evaluates on ``steps`` batches or the whole input; every example counted once.

        Returns:
          Every metric of ``eval_metrics``, ``loss`` (mean over real examples) and
          ``global_step``.
        """
        hooks = as_hook_list(hooks)
        return run_eval_loops(
            self._job,
            input_fn,
            steps=steps,
            hooks=hooks,
            checkpoint_path=checkpoint_path,
            name=name,
        )

    def predict(
        self,
        input_fn: Callable,
        predict_keys: Sequence[str] | str | None = None,
        hooks: Sequence | None = None,
        checkpoint_path: str | None = None,
        yield_single_examples: bool = True,
        *,
        gather_to_process_0: bool = False,
    ) -> Iterator:
        """Yields predictions for every example in input order (padding removed).

        In a many-process job each process yields the predictions of its own input's
        examples; ``gather_to_process_0=True`` makes process 0 yield every process's (in
        global batch order) and the others none. Either way every process must consume the
        generator to the end: each loop runs on all processes together.

        Yields:
          One dict per example (or the array itself when ``predictions`` is an array); one per
          batch with ``yield_single_examples=False``.
        """
        predict_keys = checked_predict_keys(predict_keys)  # checked now, not at the first next()
        hooks = as_hook_list(hooks)
        return run_predict_loops(
            self._job,
            input_fn,
            predict_keys=predict_keys,
            hooks=hooks,
            checkpoint_path=checkpoint_path,
            yield_single_examples=yield_single_examples,
            gather=gather_to_process_0,
        )

    def export_saved_model(
        self,
        export_dir_base: str,
        serving_input_receiver_fn: Callable,
        checkpoint_path: str | None = None,
        *,
        fold_variables: bool = False,
        platforms: Sequence[str] | None = None,
    ) -> str:
        """Exports the PREDICT computation (``jax.export``, symbolic batch) with its variables.

        Returns the new ``<export_dir_base>/<timestamp>`` directory; load it anywhere with
        ``estimator.load_saved_model``. See ``estimator/io/export.py`` for the serving input
        form and the files written.
        """
        return export_saved_model(
            self._job.programs,
            self._job.store,
            export_dir_base,
            serving_input_receiver_fn,
            checkpoint_path,
            fold_variables=fold_variables,
            platforms=platforms,
        )

    def export_savedmodel(
        self, export_dir_base: str, serving_input_receiver_fn: Callable, *args: Any, **kwargs: Any
    ) -> str:
        """TF's deprecated spelling of ``export_saved_model`` (ResNet's reference uses it)."""
        return self.export_saved_model(export_dir_base, serving_input_receiver_fn, *args, **kwargs)

    # ----------------------------------------------------------------- checkpoints
    def latest_checkpoint(self) -> str | None:
        """The directory of the newest complete checkpoint, or None."""
        return self._job.store.latest_checkpoint()

    def get_variable_names(self) -> list[str]:
        """Names of every saved variable, ``collection/module/.../leaf`` for non-params."""
        return sorted(self._saved_variables())

    def get_variable_value(self, name: str) -> np.ndarray:
        """The saved value of one variable (see ``get_variable_names``).

        Raises:
          ValueError: the name is unknown (the message lists close names).
        """
        self._require_checkpoint()
        return load_variable(self.model_dir, name)

    def _saved_variables(self) -> dict[str, np.ndarray]:
        self._require_checkpoint()
        return read_variables(self.model_dir)  # the newest readable one

    def _require_checkpoint(self) -> None:
        if self.latest_checkpoint() is None:
            raise NoCheckpointError(f"No checkpoint found in {self.model_dir}")


def _device_mesh(use_tpu: bool, tpu: TPUConfig) -> jax.sharding.Mesh:
    """Every device (``use_tpu``) or the first one, checked against ``TPUConfig.num_shards``
    and against the processes' device counts."""
    if use_tpu:
        mesh = make_mesh(num_cores_per_replica=tpu.num_cores_per_replica)
    else:
        mesh = single_device_mesh()
    multihost.check_mesh(mesh)
    replicas = num_replicas(mesh)
    if use_tpu and tpu.num_shards is not None and tpu.num_shards != replicas:
        raise EstimatorValueError(
            f"TPUConfig.num_shards={tpu.num_shards} does not match the {replicas} "
            "replicas the devices provide"
        )
    return mesh
