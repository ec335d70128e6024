"""TPUClusterResolver: where the processes of a many-host job are, and starting JAX's runtime.

The engine is JAX's own multi-process runtime (``jax.distributed``): every host runs the same
program, and ``connect()`` joins it to the job before JAX touches any device. Where the
coordinator is, how many processes there are and which one this is come from, in order:

1. the arguments (``coordinator_address``, ``num_processes``, ``process_id``);
2. a ``TF_CONFIG``-style JSON environment variable, as TensorFlow's multi-worker jobs set it::

     {"cluster": {"worker": ["host0:2222", "host1:2222"]}, "task": {"type": "worker", "index": 1}}

   The first worker (or the ``chief``, when the cluster lists one) is process 0 and hosts the
   coordinator at its address; ``tpu-estimator --num_processes N`` sets this for its children;
3. JAX's own environment detection (Cloud TPU pods and GKE TPU slices, Slurm, Open MPI,
   Kubernetes): ``jax.distributed.initialize()`` with no arguments. Naming a TPU
   (``tpu="my-pod"``) asks for this explicitly.

With none of these the job is one process and ``connect()`` does nothing. JAX 0.10 uses gloo
collectives on CPU by default, so processes on one machine form one mesh of CPU devices (that
is how the many-host code is tested).

``RunConfig`` joins the job the environment describes (2. or 3., ``from_environment()``)
unless it is given a resolver, or ``cluster=False`` (or ``TPU_ESTIMATOR_NO_CLUSTER=1``) to
run alone; the estimator joins when it is built (``start_cluster``).

Example:
  >>> resolver = estimator.TPUClusterResolver()         # TF_CONFIG, or a TPU pod / Slurm job
  >>> config = estimator.RunConfig(model_dir="gs://bucket/run", cluster=resolver)
  >>> est = estimator.TPUEstimator(model_fn, config=config, train_batch_size=1024)

A process that dies (SIGKILL, a lost machine) makes every other one exit within
``heartbeat_timeout`` seconds (default 20) with one message naming the lost process and the
last committed checkpoint, and exit code 75 (``estimator.cluster.watchdog``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

from ..core import _compat
from ..core.errors import EstimatorRuntimeError, EstimatorTypeError, EstimatorValueError
from . import watchdog

log = logging.getLogger("estimator")

TF_CONFIG = "TF_CONFIG"
# Environment overrides for the runtime's timeouts (the local launcher sets them).
TIMEOUT_ENV = {
    "initialization_timeout": "TPU_ESTIMATOR_INIT_TIMEOUT",
    "heartbeat_timeout": "TPU_ESTIMATOR_HEARTBEAT_TIMEOUT",
    "shutdown_timeout": "TPU_ESTIMATOR_SHUTDOWN_TIMEOUT",
    "stall_timeout": watchdog.STALL_TIMEOUT_ENV,
}
_DEFAULT_TIMEOUTS = {
    "initialization_timeout": 300,
    "heartbeat_timeout": 20,
    "shutdown_timeout": 60,
    "stall_timeout": watchdog.DEFAULT_STALL_TIMEOUT,
}
_LOCAL_TPU_NAMES = ("", "local")
# Set (to anything but 0/false/no/off) to keep RunConfig from joining the environment's job.
NO_CLUSTER_ENV = "TPU_ESTIMATOR_NO_CLUSTER"
_FALSE_WORDS = ("", "0", "false", "no", "off")
_connected: dict[str, Any] = {}  # what this process connected with (once per process)


class ClusterConfigError(EstimatorValueError):
    """The cluster description (arguments or TF_CONFIG) is inconsistent or malformed."""


def _int_or_none(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise EstimatorTypeError(f"{name} must be an int, got {value!r}")
    return value


def parse_tf_config(text: str, *, variable: str = TF_CONFIG) -> dict:
    """``{"workers": [...], "process_id": i}`` from a TF_CONFIG JSON string.

    The processes are the ``chief`` (if listed) followed by the ``worker`` list; the first is
    process 0 and its address is the coordinator's.

    Raises:
      ClusterConfigError: not JSON, no worker list, a task type other than chief/worker, or
        an index outside the list (the message names the variable and the key).
    """
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise ClusterConfigError(f"{variable} is not valid JSON ({e}): {text[:200]!r}") from None
    if not isinstance(spec, dict):
        raise ClusterConfigError(f"{variable} must be a JSON object, got {text[:200]!r}")
    cluster = spec.get("cluster") or {}
    if not isinstance(cluster, dict):
        raise ClusterConfigError(f"{variable}['cluster'] must be an object, got {cluster!r}")
    unsupported = sorted(set(cluster) - {"chief", "worker"})
    if unsupported:
        raise ClusterConfigError(
            f"{variable}['cluster'] lists {unsupported}; only 'chief' and 'worker' tasks exist "
            "in a JAX job (every process trains)"
        )
    chief = list(cluster.get("chief") or [])
    workers = chief + list(cluster.get("worker") or [])
    if not workers or not all(isinstance(w, str) and ":" in w for w in workers):
        raise ClusterConfigError(
            f"{variable}['cluster']['worker'] must be a non-empty list of 'host:port', got "
            f"{cluster.get('worker')!r}"
        )
    task = spec.get("task") or {}
    kind, index = task.get("type", "worker"), task.get("index", 0)
    if kind not in ("chief", "worker"):
        raise ClusterConfigError(f"{variable}['task']['type']={kind!r}; expected 'worker'")
    if isinstance(index, bool) or not isinstance(index, int):
        raise ClusterConfigError(f"{variable}['task']['index'] must be an int, got {index!r}")
    offset = 0 if kind == "chief" else len(chief)
    size = len(chief) if kind == "chief" else len(workers) - len(chief)
    if not 0 <= index < size:
        raise ClusterConfigError(
            f"{variable}['task']['index']={index} is outside the {size} {kind} task(s)"
        )
    return {"workers": workers, "chief": bool(chief), "process_id": offset + index}


def _detected_cluster() -> Any:
    """The ``ClusterEnv`` class JAX's own detection finds here, or None.

    Uses JAX's ``ClusterEnv`` registry; opt-in methods (mpi4py) are not probed.
    """
    for env in _compat.jax_cluster_types():
        if env.opt_in_only_method:
            continue
        try:
            with warnings.catch_warnings():  # e.g. "Kubernetes detected, package missing"
                warnings.simplefilter("ignore")
                if env.is_env_present():
                    return env
        except Exception as e:  # noqa: BLE001 - a broken probe must not stop the job
            log.debug("Cluster detection %s failed: %s", env.__name__, e)
    return None


def jax_cluster_environment() -> str | None:
    """The name of the cluster JAX's own detection finds here (TPU pod, Slurm, ...), or None."""
    env = _detected_cluster()
    return None if env is None else env.__name__


def _detected_process_count() -> int | None:
    """Processes in the job JAX detects (None: none detected, or it cannot tell)."""
    env = _detected_cluster()
    try:
        return None if env is None else int(env.get_process_count())
    except Exception as e:  # noqa: BLE001 - unknown: join and let JAX find out
        log.debug("Cluster detection %s gave no process count: %s", env.__name__, e)
        return None


class TPUClusterResolver:
    """The processes of a job and how to join them (TF's ``TPUClusterResolver``).

    Args:
      tpu: a Cloud TPU name (or any non-empty name other than ``"local"``): the job runs on
        every host of that TPU slice, found by JAX's TPU detection. ``None``/``"local"``: use
        the other arguments, ``TF_CONFIG``, or JAX's detection of a Slurm/MPI/TPU job.
      coordinator_address: ``host:port`` of process 0, where JAX's coordination service runs.
      num_processes: processes in the job.
      process_id: this process's index, ``0 <= process_id < num_processes``.
      initialization_timeout: seconds to wait for every process to join (default 300).
      heartbeat_timeout: seconds without heartbeats after which a process counts as lost:
        every other process logs one error naming it and the last committed checkpoint, and
        exits with code 75 (default 20; ``estimator.cluster.watchdog``).
      shutdown_timeout: seconds a finishing process waits for the others at exit (default
        60).
      stall_timeout: seconds a process may go without progress (the step it reached, its
        phase) while others wait for it, before every process exits 75 naming it (default
        1800, above the largest legitimate compile; ``TPU_ESTIMATOR_STALL_TIMEOUT``).
      env_var: the TF_CONFIG-style variable to read.
      zone, project, job_name, coordinator_name, credentials, service, discovery_url: TF's
        Cloud TPU API arguments, keyword-only; accepted so ported programs run unchanged, and
        ignored with one warning naming those given.

    Each timeout can also be set by an environment variable (``TPU_ESTIMATOR_INIT_TIMEOUT``,
    ``TPU_ESTIMATOR_HEARTBEAT_TIMEOUT``, ``TPU_ESTIMATOR_SHUTDOWN_TIMEOUT``) when the
    argument is not given.

    Raises:
      ClusterConfigError: TF_CONFIG is malformed or contradicts the arguments.

    Example:
      >>> r = TPUClusterResolver(coordinator_address="10.0.0.1:1234", num_processes=2,
      ...                        process_id=1)
      >>> r.cluster_spec(), r.num_processes, r.process_id
      ({'worker': ['10.0.0.1:1234']}, 2, 1)
      >>> r.connect()        # once per process, before JAX uses any device
    """

    def __init__(
        self,
        tpu: str | None = None,
        coordinator_address: str | None = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        *,
        initialization_timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        shutdown_timeout: float | None = None,
        stall_timeout: float | None = None,
        env_var: str = TF_CONFIG,
        zone: str | None = None,
        project: str | None = None,
        job_name: str | None = None,
        coordinator_name: str | None = None,
        credentials: Any = None,
        service: Any = None,
        discovery_url: str | None = None,
    ):
        tf_only = {
            "zone": zone,
            "project": project,
            "job_name": job_name,
            "coordinator_name": coordinator_name,
            "credentials": credentials,
            "service": service,
            "discovery_url": discovery_url,
        }
        ignored = [name for name, value in tf_only.items() if value is not None]
        if ignored:
            log.warning(
                "TPUClusterResolver: %s ignored (Cloud TPU API settings; JAX finds the "
                "devices and processes itself)",
                ", ".join(ignored),
            )
        self.tpu = tpu
        self._env_var = env_var
        self._workers: list[str] | None = None
        self._chief = False
        num_processes = _int_or_none("num_processes", num_processes)
        process_id = _int_or_none("process_id", process_id)
        text = os.environ.get(env_var)
        if text and tpu in (None, *_LOCAL_TPU_NAMES):
            parsed = parse_tf_config(text, variable=env_var)
            self._workers, self._chief = parsed["workers"], parsed["chief"]
            coordinator_address = _merge(
                "coordinator_address", coordinator_address, self._workers[0], env_var
            )
            num_processes = _merge("num_processes", num_processes, len(self._workers), env_var)
            process_id = _merge("process_id", process_id, parsed["process_id"], env_var)
        self.coordinator_address = coordinator_address
        self.num_processes = num_processes
        self.process_id = process_id
        self.timeouts = {
            "initialization_timeout": initialization_timeout,
            "heartbeat_timeout": heartbeat_timeout,
            "shutdown_timeout": shutdown_timeout,
            "stall_timeout": stall_timeout,
        }
        for name, value in self.timeouts.items():
            self.timeouts[name] = watchdog.timeout_seconds(
                name, value, env=TIMEOUT_ENV[name], default=_DEFAULT_TIMEOUTS[name]
            )
        self._check()

    def _check(self) -> None:
        n, i = self.num_processes, self.process_id
        if n is not None and n < 1:
            raise EstimatorValueError(f"num_processes must be >= 1, got {n}")
        if i is not None and i < 0:
            raise EstimatorValueError(f"process_id must be >= 0, got {i}")
        if n is not None and i is not None and i >= n:
            raise EstimatorValueError(f"process_id={i} must be smaller than num_processes={n}")
        if self.coordinator_address is not None and ":" not in str(self.coordinator_address):
            raise EstimatorValueError(
                f"coordinator_address must be 'host:port', got {self.coordinator_address!r}"
            )

    # ----------------------------------------------------------------- what kind of job
    @property
    def mode(self) -> str:
        """``"explicit"`` (arguments or TF_CONFIG), ``"auto"`` (JAX's detection) or ``"local"``."""
        if self.tpu not in (None, *_LOCAL_TPU_NAMES):
            return "auto"
        if self.num_processes is not None and self.num_processes > 1:
            return "explicit"
        if self.num_processes is None and self.coordinator_address is not None:
            return "explicit"
        if self.num_processes is None and jax_cluster_environment() is not None:
            return "auto"
        return "local"

    @property
    def source(self) -> str:
        """Where the job's description came from, for messages: ``"TF_CONFIG"`` (the
        variable read), ``"the arguments"``, JAX's detection (``"SlurmCluster"``, ...) or
        ``"nothing"`` (one process)."""
        mode = self.mode
        if mode == "local":
            return "nothing"
        if self._workers is not None:
            return self._env_var
        if mode == "explicit":
            return "the arguments"
        return jax_cluster_environment() or f"the TPU {self.tpu!r}"

    def cluster_spec(self) -> dict[str, list[str]]:
        """The job's tasks as TF's ``ClusterSpec.as_dict()``: ``{"worker": [...]}``.

        From TF_CONFIG: its task lists. From arguments only the coordinator's address is
        known (``{"worker": [coordinator_address]}``); a one-process job gives ``{}``.
        """
        if self._workers is not None:
            if self._chief:
                return {"chief": self._workers[:1], "worker": self._workers[1:]}
            return {"worker": list(self._workers)}
        if self.coordinator_address is not None:
            return {"worker": [self.coordinator_address]}
        return {}

    def master(self) -> str:
        """The coordinator's ``host:port`` ("" for a one-process job), as TF's ``master()``."""
        return self.coordinator_address or ""

    # ----------------------------------------------------------------- connect
    def connect(self) -> None:
        """Starts ``jax.distributed`` for this process, once; a no-op for one process.

        Must run before JAX uses any device (``jax.devices()``, a computation, ...).
        ``RunConfig(cluster=...)`` and ``TPUStrategy(cluster_resolver)`` call it.

        Raises:
          RuntimeError: JAX already used a device in this process, or the process already
            joined a different job.
        """
        mode = self.mode
        if mode == "local":
            return
        wanted = {
            "coordinator_address": self.coordinator_address,
            "num_processes": self.num_processes,
            "process_id": self.process_id,
        }
        if _connected:
            _check_same_job(_connected, wanted)
            return
        import jax

        if jax.distributed.is_initialized():  # the user started the runtime themselves
            _connected.update(wanted)
            return
        if _compat.backends_are_initialized():
            raise EstimatorRuntimeError(
                "TPUClusterResolver.connect() must run before JAX uses any device (a "
                "computation, jax.devices(), jax.device_put, ...): construct the TPUEstimator "
                "or TPUStrategy (or call connect()) first in the program"
            )
        kwargs = {k: v for k, v in wanted.items() if v is not None}
        log.info(
            "Joining a %s-process job (process %s, coordinator %s).",
            self.num_processes or "?",
            self.process_id if self.process_id is not None else "?",
            self.coordinator_address or "auto-detected",
        )
        try:
            jax.distributed.initialize(
                **kwargs,
                initialization_timeout=math.ceil(self.timeouts["initialization_timeout"]),
                # JAX's own detection (an abort from C++) stays behind the watchdog's.
                heartbeat_timeout_seconds=watchdog.jax_heartbeat_timeout(
                    self.timeouts["heartbeat_timeout"]
                ),
                shutdown_timeout_seconds=math.ceil(self.timeouts["shutdown_timeout"]),
            )
        except ValueError as e:  # JAX's detection found nothing to complete the arguments
            raise ClusterConfigError(
                f"{self!r}: JAX found no TPU slice or cluster (Slurm, MPI, Kubernetes) to "
                f"join ({e}); give coordinator_address, num_processes and process_id, or set "
                f"{TF_CONFIG}"
            ) from e
        _connected.update(wanted)
        if self.num_processes is None:
            self.num_processes = jax.process_count()
            self.process_id = jax.process_index()
        _use_distributed_checkpoint_barriers()
        watchdog.start(
            process_id=jax.process_index(),
            num_processes=jax.process_count(),
            bound=self.timeouts["heartbeat_timeout"],
            stall_timeout=self.timeouts["stall_timeout"],
        )
        log.info(
            "Process %d of %d: %d local devices, %d in all.",
            jax.process_index(),
            jax.process_count(),
            jax.local_device_count(),
            jax.device_count(),
        )

    def __repr__(self) -> str:
        return (
            f"TPUClusterResolver(mode={self.mode!r}, coordinator_address="
            f"{self.coordinator_address!r}, num_processes={self.num_processes}, "
            f"process_id={self.process_id})"
        )


def _merge(name: str, given: Any, from_env: Any, env_var: str) -> Any:
    if given is not None and given != from_env:
        raise ClusterConfigError(
            f"{name}={given!r} contradicts {env_var}, which gives {from_env!r}"
        )
    return from_env


def _check_same_job(connected: dict, wanted: dict) -> None:
    for key, value in wanted.items():
        if value is not None and connected.get(key) is not None and connected[key] != value:
            raise EstimatorRuntimeError(
                f"this process already joined a job with {key}={connected[key]!r}; "
                f"cannot join another with {key}={value!r}"
            )


def _use_distributed_checkpoint_barriers() -> None:
    """Makes Orbax synchronise processes through JAX's coordination service.

    By default Orbax's barriers are device collectives; run from its background save thread
    they can interleave with the training loop's collectives in a different order on each
    process and deadlock. The coordination-service barrier is safe from any thread.
    """
    try:
        _compat.set_absl_flag("experimental_orbax_use_distributed_barrier", True)
    except Exception as e:  # noqa: BLE001 - an Orbax without the flag
        log.warning(
            "Could not switch Orbax to distributed barriers (%s); checkpoints written "
            "while training may stall on many processes.",
            e,
        )


def start_cluster(
    cluster: Any,
    *,
    model_dir: str | None,
    latest_checkpoint: Callable[[str], str | None] | None = None,
) -> Any:
    """Joins the job of ``RunConfig.cluster`` before JAX uses a device; returns the resolver.

    ``cluster`` is anything with ``connect()`` (a ``TPUClusterResolver``); ``None`` means the
    job the environment describes (``from_environment()``: ``TF_CONFIG`` or a cluster JAX
    detects), as TF's RunConfig read ``TF_CONFIG``; ``False`` runs this process alone.
    ``latest_checkpoint(model_dir)`` is what the host-loss message names as the last
    committed checkpoint.

    Returns:
      The resolver joined, or None when this process runs alone.

    Raises:
      TypeError: ``cluster`` has no ``connect()`` method.
      ValueError: a many-process job without a ``model_dir`` (each process would pick its
        own temporary directory, and checkpoints are written by all of them together).
      RuntimeError: JAX already used a device (the message names the opt-outs when the job
        came from the environment).

    Example:
      >>> start_cluster(None, model_dir="/runs/a")      # joins TF_CONFIG's job, if any
    """
    if cluster is False:
        return None
    automatic = cluster is None
    if automatic:
        cluster = from_environment()
        if cluster is None:
            return None
    connect = getattr(cluster, "connect", None)
    if not callable(connect):
        raise EstimatorTypeError(
            f"RunConfig.cluster must be a TPUClusterResolver (or have connect()), None or "
            f"False, got {cluster!r}"
        )
    try:
        connect()
    except (EstimatorRuntimeError, ClusterConfigError) as e:
        if not automatic:
            raise
        # The user never named a cluster: say where the job came from and how to run alone.
        raise type(e)(
            f"{e}. This process joins the job {cluster.source} describes because "
            f"RunConfig(cluster=None) joins it, as TF's RunConfig did; pass "
            f"RunConfig(cluster=False) or set {NO_CLUSTER_ENV}=1 to run it alone"
        ) from e
    import jax

    if model_dir is None and jax.process_count() > 1:
        raise EstimatorValueError(
            "model_dir must be set in a many-process job: every process writes the same "
            "checkpoints (use a directory all hosts see, e.g. a bucket or shared disk)"
        )
    if latest_checkpoint is not None:
        watchdog.watch_model_dir(model_dir, latest_checkpoint)
    return cluster


def from_environment() -> TPUClusterResolver | None:
    """A resolver when the environment describes a many-process job, else None.

    The job comes from ``TF_CONFIG`` (as the local launcher sets it) or a cluster JAX
    detects (a TPU pod, Slurm, Open MPI, Kubernetes) of more than one process (a one-host TPU
    VM is detected too, and has nothing to join). ``TPU_ESTIMATOR_NO_CLUSTER=1`` makes it
    None whatever the environment says. ``RunConfig(cluster=None)`` and the
    ``tpu-estimator`` command use it.

    Example:
      >>> spec = {"cluster": {"worker": ["h0:1", "h1:1"]}, "task": {"index": 1}}
      >>> os.environ["TF_CONFIG"] = json.dumps(spec)
      >>> from_environment().process_id
      1
    """
    if os.environ.get(NO_CLUSTER_ENV, "").strip().lower() not in _FALSE_WORDS:
        return None
    resolver = TPUClusterResolver()
    if resolver.mode == "local":
        return None
    # A one-host TPU VM is "detected" too: a job of one process has nothing to join, and
    # joining it would refuse a program that already used JAX.
    if resolver.mode == "auto" and _detected_process_count() == 1:
        return None
    return resolver
