"""TPUEstimator: one model_fn, compiled train/eval/predict loops on every device.

Example:
  >>> est = estimator.TPUEstimator(model_fn, model_dir="/tmp/mlp", train_batch_size=128,
  ...                              eval_batch_size=128, params={"hidden": 256},
  ...                              config=estimator.RunConfig(save_checkpoints_steps=100))
  >>> est.train(train_input_fn, max_steps=1000)
  >>> est.evaluate(eval_input_fn)        # {'accuracy': 0.97, 'loss': 0.1, 'global_step': 1000}
  >>> next(est.predict(predict_input_fn))

Current limitations are listed in the README.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from hooks import SessionRunHook

from . import runtime
from .cluster.cluster import start_cluster
from .config import InputPipelineConfig, RunConfig
from .data.inputs import Pipeline, Prefetcher, call_input_fn, read_chunk
from .data.synced import synced
from .driver.evaluation import run_eval_loops
from .driver.prediction import run_predict_loops
from .driver.training import run_train_loops
from .engine.loops import SpecHolder, make_eval_loop, make_init, make_train_loop
from .engine.model import ModelFn, user_params
from .errors import NoCheckpointError
from .input_context import InputContext
from .io import checkpoint as ckpt_lib
from .io.export import export_saved_model
from .parallel import multihost, partitioning
from .parallel.mesh import make_mesh, num_replicas, single_device_mesh
from .spec import ModeKeys

log = logging.getLogger("estimator")


class TPUEstimator:
    """TF's ``tf.estimator.tpu.TPUEstimator`` on JAX.

    Args:
      model_fn: ``model_fn(features, labels, mode, params[, config])`` returning a
        ``TPUEstimatorSpec``; it builds the model for one replica.
      model_dir: checkpoints and summaries; must equal ``config.model_dir`` when both are set.
      config: a ``RunConfig``.
      params: hyperparameters, deep-copied; ``batch_size`` and ``context`` are reserved.
      use_tpu: ``True`` replicates over every device; ``False`` runs one device on the global
        batch (same code path).
      train_batch_size, eval_batch_size, predict_batch_size: global batch sizes.
      warm_start_from: a checkpoint path or ``WarmStartSettings`` applied on a fresh start.
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
    ):
        if not callable(model_fn):
            raise TypeError(f"model_fn must be callable, got {type(model_fn).__name__}")
        config = config if config is not None else RunConfig()
        if not isinstance(config, RunConfig):
            raise TypeError(f"config must be an estimator.RunConfig, got {type(config).__name__}")
        start_cluster(config.cluster, model_dir=model_dir or config.model_dir)  # before devices
        self._config = config.replace(model_dir=_model_dir(model_dir, config))
        runtime.setup(self._config)
        self._params = user_params(params)
        self._model = ModelFn(model_fn, self._params, self._config)
        self._use_tpu = bool(use_tpu)
        tpu = self._config.tpu_config
        if self._use_tpu:
            self._mesh = make_mesh(num_cores_per_replica=tpu.num_cores_per_replica)
        else:
            self._mesh = single_device_mesh()
        multihost.check_mesh(self._mesh)
        self._replicas = num_replicas(self._mesh)
        self._model.num_replicas = self._replicas
        self._model.num_cores_per_replica = self._mesh.shape["model"]
        if self._use_tpu and tpu.num_shards is not None and tpu.num_shards != self._replicas:
            raise ValueError(
                f"TPUConfig.num_shards={tpu.num_shards} does not match the {self._replicas} "
                "replicas the devices provide"
            )
        self._batch = {
            ModeKeys.TRAIN: self._check_batch("train_batch_size", train_batch_size, use_tpu),
            ModeKeys.EVAL: self._check_batch("eval_batch_size", eval_batch_size, False),
            ModeKeys.PREDICT: self._check_batch("predict_batch_size", predict_batch_size, False),
        }
        self._warm_start_from = warm_start_from
        self._holder = SpecHolder()
        self._compiled: dict = {}
        self._var_specs = None  # PartitionSpecs of the variables, known once model_fn is traced
        self._checkpoints: ckpt_lib.Checkpoints | None = None
        # (step, TrainState, meta) left by the last train(), equal to its final checkpoint.
        self._live: tuple | None = None
        self._stopped_by_hook = False  # whether the last train() ended on a hook's request

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
        return os.path.join(self.model_dir, "eval" if not name else f"eval_{name}")

    # ----------------------------------------------------------------- batches
    def _check_batch(self, field: str, value: Any, required: bool) -> int | None:
        if value is None:
            if required:
                raise ValueError(f"{field} must be set when use_tpu=True")
            return None
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{field} must be an int, got {type(value).__name__}")
        if value <= 0:
            raise ValueError(f"{field} must be positive, got {value}")
        mode_cfg = self._config.tpu_config.per_host_input_for_training
        if mode_cfg != InputPipelineConfig.BROADCAST and value % self._replicas:
            raise ValueError(
                f"{field}={value} is not divisible by the number of replicas ({self._replicas})"
            )
        return int(value)

    def _global_batch(self, mode: str) -> int:
        batch = self._batch[mode]
        if batch is None:
            if self._use_tpu:
                field = {"train": "train_batch_size", "eval": "eval_batch_size"}.get(
                    mode, "predict_batch_size"
                )
                raise ValueError(f"{field} must be set to run {mode} with use_tpu=True")
        return batch

    def _replica_batch(self, global_batch: int) -> int:
        if self._config.tpu_config.per_host_input_for_training == InputPipelineConfig.BROADCAST:
            return global_batch
        return global_batch // self._replicas

    def _input_params(self, global_batch: int | None) -> dict:
        params = user_params(self._params)
        if global_batch is None:
            return params
        mode_cfg = self._config.tpu_config.per_host_input_for_training
        if mode_cfg in (InputPipelineConfig.PER_HOST_V2, InputPipelineConfig.PER_SHARD_V1):
            params["batch_size"] = global_batch // self._replicas
        elif mode_cfg == InputPipelineConfig.BROADCAST:
            params["batch_size"] = global_batch
        else:
            params["batch_size"] = global_batch // jax.process_count()
        return params

    def _pipeline(self, input_fn: Callable, mode: str, *, pad: bool) -> Pipeline:
        global_batch = self._global_batch(mode)
        it = call_input_fn(
            input_fn,
            params=self._input_params(global_batch),
            config=self._config,
            mode=mode,
            input_context=InputContext(jax.process_count(), jax.process_index(), self._replicas),
        )
        mode_cfg = self._config.tpu_config.per_host_input_for_training
        local = multihost.local_replicas(self._mesh)  # this process feeds only its replicas
        if global_batch is not None and mode_cfg != InputPipelineConfig.BROADCAST:
            global_batch = global_batch * local // self._replicas
        return Pipeline(
            it, mode_cfg=mode_cfg, global_batch=global_batch, num_replicas=local, pad=pad
        )

    def _prefetch(
        self, pipe: Pipeline, schedule: Callable[[], int], *, fill: bool, skip: int = 0
    ) -> Prefetcher:
        def produce():
            if skip and pipe.pulled == 0:
                done = pipe.skip(skip)
                if done < skip:
                    log.warning("Input ended while skipping %d consumed batches.", skip)
            n = schedule()
            return read_chunk(pipe, n, fill=fill, mesh=self._mesh) if n > 0 else None

        return synced(Prefetcher(produce), pipe, fill=fill, mesh=self._mesh)

    # ----------------------------------------------------------------- compiled loops
    def _loop(self, kind: str, batch_size: int):
        key = (kind, batch_size)
        if key not in self._compiled:
            tpu = self._config.tpu_config
            unroll = tpu.unroll_loops
            if unroll is None:  # XLA:CPU runs convolutions in rolled loops slowly
                unroll = jax.default_backend() == "cpu" and tpu.iterations_per_loop <= 10
            if kind == "init_train":
                fn = make_init(
                    self._model,
                    self._mesh,
                    self._holder,
                    mode=ModeKeys.TRAIN,
                    batch_size=batch_size,
                )
            elif kind.startswith("init_"):
                fn = make_init(
                    self._model, self._mesh, self._holder, mode=kind[5:], batch_size=batch_size
                )
            elif kind == ModeKeys.TRAIN:
                fn = make_train_loop(
                    self._model,
                    self._mesh,
                    self._holder,
                    batch_size=batch_size,
                    unroll=unroll,
                    skip_nonfinite=self._config.skip_nonfinite_steps,
                    var_specs=self._var_specs,
                    input_specs=self._input_specs(),
                )
            else:
                fn = make_eval_loop(
                    self._model,
                    self._mesh,
                    self._holder,
                    mode=kind,
                    batch_size=batch_size,
                    unroll=unroll,
                    input_specs=self._input_specs(),
                )
            self._compiled[key] = fn
        return self._compiled[key]

    def _input_specs(self) -> tuple:
        """(features, labels) PartitionSpecs from ``TPUConfig.input_partition_dims``."""
        tpu = self._config.tpu_config
        dims = tpu.input_partition_dims
        if not dims:
            return (None, None)

        def specs(d):
            if d is None:
                return None
            if isinstance(d, dict):
                return {k: specs(v) for k, v in d.items()}
            return partitioning.partition_spec_from_dims(
                d, num_cores_per_replica=tpu.num_cores_per_replica
            )

        return specs(dims[0]), specs(dims[1]) if len(dims) > 1 else None

    def _writer_checkpoints(self) -> ckpt_lib.Checkpoints:
        if self._checkpoints is None:
            self._checkpoints = ckpt_lib.Checkpoints(
                self.model_dir, max_to_keep=self._config.keep_checkpoint_max
            )
        return self._checkpoints

    def _reader_checkpoints(self, model_dir: str | None = None) -> ckpt_lib.Checkpoints:
        if model_dir is None or os.path.abspath(model_dir) == os.path.abspath(self.model_dir):
            if self._checkpoints is not None:
                self._checkpoints.wait()
                return self._checkpoints
            model_dir = self.model_dir
        return ckpt_lib.Checkpoints(model_dir, read_only=True)

    # ----------------------------------------------------------------- train
    def train(
        self,
        input_fn: Callable,
        hooks: Sequence | None = None,
        steps: int | None = None,
        max_steps: int | None = None,
    ) -> TPUEstimator:
        """Trains until ``steps`` more steps, ``max_steps`` in all, or the end of the input.

        Resumes from the latest checkpoint in ``model_dir``; returns when every host call,
        hook and checkpoint write has finished.

        Raises:
          ValueError: ``steps``/``max_steps`` both set or not positive.
          NanLossDuringTrainingError: a NaN or Inf loss (no checkpoint of it is written).
        """
        _check_steps(steps, max_steps)
        _check_hooks(hooks)
        run_train_loops(self, input_fn, hooks=hooks, steps=steps, max_steps=max_steps)
        return self

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
        if steps is not None and (not isinstance(steps, int) or steps <= 0):
            raise ValueError(f"Must specify steps > 0, given: {steps}")
        _check_hooks(hooks)
        return run_eval_loops(
            self,
            input_fn,
            ModeKeys.EVAL,
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
        if isinstance(predict_keys, str):
            predict_keys = [predict_keys]
        if predict_keys is not None and (
            not isinstance(predict_keys, (list, tuple))
            or not all(isinstance(k, str) for k in predict_keys)
        ):
            raise TypeError(f"predict_keys must be a str or a list of str, got {predict_keys!r}")
        _check_hooks(hooks)
        return run_predict_loops(
            self,
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
        ``estimator.load_saved_model``. See ``estimator/export.py`` for the serving input
        form and the files written.
        """
        return export_saved_model(
            self,
            export_dir_base,
            serving_input_receiver_fn,
            checkpoint_path,
            fold_variables=fold_variables,
            platforms=platforms,
        )

    # ----------------------------------------------------------------- checkpoints
    def latest_checkpoint(self) -> str | None:
        """The directory of the newest complete checkpoint, or None."""
        ckpts = self._reader_checkpoints()
        steps = ckpts.steps()
        return ckpts.path(steps[-1]) if steps else None

    def get_variable_names(self) -> list[str]:
        """Names of every saved variable, ``collection/module/.../leaf`` for non-params."""
        return sorted(self._saved_variables())

    def get_variable_value(self, name: str) -> np.ndarray:
        """The saved value of one variable (see ``get_variable_names``).

        Raises:
          ValueError: the name is unknown (the message lists close names).
        """
        variables = self._saved_variables()
        if name not in variables:
            close = [n for n in variables if name.split("/")[-1] in n][:5]
            raise ValueError(f"Variable {name!r} not found in checkpoint; similar: {close}")
        return variables[name]

    def _saved_variables(self) -> dict[str, np.ndarray]:
        path = self.latest_checkpoint()
        if path is None:
            raise NoCheckpointError(f"No checkpoint found in {self.model_dir}")
        return ckpt_lib.read_variables(self.model_dir)  # the newest readable one


def _model_dir(model_dir: str | None, config: RunConfig) -> str:
    if model_dir is not None and config.model_dir is not None:
        if os.path.abspath(str(model_dir)) != os.path.abspath(config.model_dir):
            raise ValueError(
                f"model_dir={model_dir!r} differs from config.model_dir={config.model_dir!r}"
            )
    chosen = model_dir if model_dir is not None else config.model_dir
    if chosen is None:
        chosen = tempfile.mkdtemp(prefix="tpu_estimator_")
        log.warning("Using temporary folder as model directory: %s", chosen)
    return str(chosen)


def _check_hooks(hooks) -> None:
    """``hooks`` must be a list of SessionRunHook; a single hook is a common slip."""
    if isinstance(hooks, SessionRunHook):
        raise TypeError(
            f"hooks must be a list of SessionRunHook, got a single "
            f"{type(hooks).__name__}; pass [hook]"
        )
    if hooks is not None and (isinstance(hooks, (str, bytes)) or not hasattr(hooks, "__iter__")):
        raise TypeError(f"hooks must be a list of SessionRunHook, got {type(hooks).__name__}")
    for hook in hooks if isinstance(hooks, (list, tuple)) else ():  # fail before any work
        if not isinstance(hook, SessionRunHook):
            raise TypeError(f"hooks must be SessionRunHook instances, given: {hook!r}")


def _check_steps(steps, max_steps) -> None:
    if steps is not None and max_steps is not None:
        raise ValueError("Can not provide both steps and max_steps.")
    for name, value in (("steps", steps), ("max_steps", max_steps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value is not None and value <= 0:
            raise ValueError(f"Must specify {name} > 0, given: {value}")
