"""From an input_fn to chunks of global batches on the devices, read ahead on a thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import jax
from jax.sharding import Mesh

from ..config import RunConfig
from ..engine.model import user_params
from ..input_context import InputContext
from ..tpu_context import input_fn_context
from .inputs import Pipeline, Prefetcher, call_input_fn, read_chunk
from .layout import BatchLayout
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
      >>> chunks = feeder.prefetch(pipe, lambda: 4, fill=True)   # 4 steps per chunk
    """

    def __init__(self, layouts: dict[str, BatchLayout], params: dict, config: RunConfig, mesh):
        self.layouts, self.params, self.config = layouts, params, config
        self.mesh: Mesh = mesh

    def layout(self, mode: str) -> BatchLayout:
        return self.layouts[mode]

    def input_params(self, mode: str) -> dict:
        """input_fn's ``params``: the user's, plus ``batch_size`` when it is known and
        ``context`` (TF's TPUContext: replicas, hosts, ``current_input_fn_deployment()``)."""
        params = user_params(self.params)
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
        *,
        fill: bool,
        skip: int = 0,
        interrupt: threading.Event | None = None,
    ):
        """Chunks of ``schedule()`` steps each, read ahead on a thread and agreed across
        processes; ``skip`` batches already consumed are passed over first. Once
        ``interrupt`` is set, a wait for the next chunk ends as the end of the input."""

        def produce():
            if skip and pipe.pulled == 0:
                done = pipe.skip(skip)
                if done < skip:
                    log.warning("Input ended while skipping %d consumed batches.", skip)
            n = schedule()
            return read_chunk(pipe, n, fill=fill, mesh=self.mesh) if n > 0 else None

        prefetcher = Prefetcher(produce, interrupt=interrupt)
        return synced(prefetcher, pipe, fill=fill, mesh=self.mesh)
