"""A ``Job`` built from the estimator's real collaborators, without an estimator, and
recording hooks for the driver tests."""

from __future__ import annotations

from estimator.core.spec import ModeKeys
from estimator.data.feeder import Feeder
from estimator.data.layout import batch_layouts
from estimator.driver.job import Job
from estimator.engine.model import ModelFn, user_params
from estimator.engine.programs import Programs
from estimator.io.store import StateStore
from estimator.parallel.mesh import single_device_mesh
from hooks import SessionRunHook
from tests import helpers as h


def make_job(model_dir, *, model_fn=h.model_fn, batch: int = 8, ipl: int = 2, **cfg) -> Job:
    """One device, ``batch`` rows in every mode, ``ipl`` steps per loop (``cfg`` goes to
    ``RunConfig``), as ``TPUEstimator(use_tpu=False)`` assembles it."""
    config = h.config(model_dir, iterations_per_loop=ipl, **cfg)
    mesh = single_device_mesh()
    params = user_params({})
    model = ModelFn(model_fn, params, config)
    model.num_replicas, model.num_cores_per_replica, model.use_tpu = 1, 1, False
    layouts = batch_layouts(
        {ModeKeys.TRAIN: batch, ModeKeys.EVAL: batch, ModeKeys.PREDICT: batch},
        replicas=1,
        local_replicas=1,
        pipeline=config.tpu_config.per_host_input_for_training,
        use_tpu=False,
    )
    return Job(
        config=config,
        mesh=mesh,
        model=model,
        programs=Programs(model, mesh, config),
        store=StateStore(config.model_dir, keep_checkpoint_max=config.keep_checkpoint_max),
        feeder=Feeder(layouts, params, config, mesh),
    )


class Recorder(SessionRunHook):
    """Appends ``(name, event, detail)`` for every hook call to a shared ``log``.

    ``detail`` is the session's global step (after_create_session, end), the loop's steps
    (before_run, after_run) and, after a loop, the length of the fetched ``loss``.
    """

    def __init__(self, name: str, log: list, *, stop_at: int | None = None, on_after_run=None):
        self.name, self.log, self.stop_at, self.on_after_run = name, log, stop_at, on_after_run

    def begin(self):
        self.log.append((self.name, "begin", None))

    def after_create_session(self, session, coord):
        self.log.append((self.name, "after_create_session", session.global_step))

    def before_run(self, run_context):
        self.log.append((self.name, "before_run", [int(s) for s in run_context.steps]))
        return {"loss": "loss"}

    def after_run(self, run_context, run_values):
        steps = [int(s) for s in run_context.steps]
        self.log.append((self.name, "after_run", (steps, len(run_values.results["loss"]))))
        if self.stop_at is not None and steps[-1] >= self.stop_at:
            run_context.request_stop()
        if self.on_after_run is not None:
            self.on_after_run(steps)

    def end(self, session):
        self.log.append((self.name, "end", session.global_step))


def events(log: list, name: str, event: str) -> list:
    """The details of one hook's calls of one kind, in order."""
    return [d for n, e, d in log if n == name and e == event]
