"""From an input_fn to chunks of global batches on the devices, read ahead on a thread."""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable

import jax
from jax.sharding import Mesh

from ..core.config import RunConfig
from ..core.input_context import InputContext
from ..core.tpu_context import input_fn_context
from .inputs import Pipeline, Prefetcher, call_input_fn
from .layout import BatchLayout, LoopPolicy
from .plan import input_budget
from .staging import stream_calls
from .synced import synced

log = logging.getLogger("estimator")


class Feeder:
    """Opens input pipelines for each mode and prefetches their chunks.

    Args:
      layouts: the ``BatchLayout`` of each mode.
      params: the user's params (input_fn gets a copy plus ``batch_size``).
      config: the estimator's ``RunConfig`` (input_fn may take it).
      mesh: the mesh the chunks are placed on.

    Example:
      >>> pipe = feeder.pipeline(input_fn, ModeKeys.EVAL, pad=True)
      >>> policy = feeder.layout(ModeKeys.EVAL).loop_policy(unrolled=False)
      >>> chunks = feeder.prefetch(pipe, lambda: 4, policy)   # loops of 4 steps
    """

    def __init__(self, layouts: dict[str, BatchLayout], params: dict, config: RunConfig, mesh):
        self.layouts, self.params, self.config = layouts, params, config
        self.mesh: Mesh = mesh

    def layout(self, mode: str) -> BatchLayout:
        return self.layouts[mode]

    def input_params(self, mode: str) -> dict:
        """input_fn's ``params``: the user's, plus ``batch_size`` when it is known and
        ``context`` (TF's TPUContext: replicas, hosts, ``current_input_fn_deployment()``)."""
        # A copy per call (input_fn may change it); the facade checked the user's params.
        params = copy.deepcopy(self.params)
        layout = self.layouts[mode]
        if layout.input_batch_size is not None:
            params["batch_size"] = layout.input_batch_size
        params["context"] = input_fn_context(
            mode,
            num_replicas=layout.replicas,
            local_replicas=layout.local_replicas,
            cores_per_replica=self.mesh.shape.get("model", 1),
        )
        return params

    def pipeline(self, input_fn: Callable, mode: str, *, pad: bool) -> Pipeline:
        """Calls input_fn for ``mode`` and wraps its iterator in a ``Pipeline``."""
        layout = self.layouts[mode]
        layout.check_given()
        it = call_input_fn(
            input_fn,
            params=self.input_params(mode),
            config=self.config,
            mode=mode,
            input_context=InputContext(jax.process_count(), jax.process_index(), layout.replicas),
        )
        return Pipeline(it, layout=layout, pad=pad)

    def prefetch(
        self,
        pipe: Pipeline,
        schedule: Callable[[], int],
        policy: LoopPolicy,
        *,
        skip: int = 0,
        interrupt: threading.Event | None = None,
        pad_short: Callable[[int, int], bool] | None = None,
    ):
        """The chunks of every compiled call, staged ahead on a thread and agreed across
        processes. ``schedule()`` gives each loop's steps (<= 0 ends); ``policy`` is the
        mode's ``LoopPolicy`` (``BatchLayout.loop_policy``); ``skip`` batches already
        consumed are passed over first. Once ``interrupt`` is set, a wait for the next chunk
        ends as the end of the input. ``pad_short(real, planned)`` (eval and predict) may run
        a call the input cut short padded to its planned length instead (``engine/tails.py``)."""
        tpu = self.config.tpu_config
        chunks = stream_calls(
            pipe,
            mesh=self.mesh,
            next_loop=schedule,
            policy=policy,
            iterations_per_loop=tpu.iterations_per_loop,
            budget=input_budget(
                tpu.max_staged_input_bytes,
                platform=self.mesh.devices.flat[0].platform,
                local_devices=len(self.mesh.local_devices),
                mode=policy.mode,
            ),
            skip=skip,
            on_skip_short=lambda n: log.warning(
                "Input ended while skipping %d consumed batches.", n
            ),
            pad_short=pad_short,
        )
        # One call staged ahead: with two running or queued and one being transferred, at
        # most four calls' input are on a device at once.
        prefetcher = Prefetcher(
            chunks, depth=1, interrupt=interrupt, on_close=pipe.log_short_skipped
        )
        return synced(prefetcher, pipe, pads=policy.pads, mesh=self.mesh)
