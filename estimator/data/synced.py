"""Input chunks agreed across processes, so every process runs the same loops."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ..errors import EstimatorValueError
from ..parallel import multihost
from .inputs import Chunk, to_devices


class SyncedChunks:
    """The prefetcher's chunks, agreed across processes so all run the same loops.

    Each process's input may end at a different point. For evaluation and prediction
    (``fill=True``) the calls go on while any process has rows; a process whose input ended
    contributes all-padding steps, and a call runs only the steps where some process has
    rows. For training the loop length is the shortest process's,
    and training ends when any input ends. The host mask becomes the global one, matching
    the global arrays the loops return.
    """

    def __init__(self, prefetch: Any, pipe: Any, *, fill: bool, mesh: Mesh):
        self._prefetch, self._pipe, self._fill, self._mesh = prefetch, pipe, fill, mesh
        self._ended = False

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        chunk = None if self._ended else next(self._prefetch, None)
        self._ended = chunk is None
        local = 0 if chunk is None else chunk.steps
        steps = multihost.gather(np.array([local], np.int64))[:, 0]  # real steps per process
        if self._fill:
            n = int(steps.max())
            if not n:
                raise StopIteration
            if chunk is None:
                chunk = self._empty_chunk(n)
            elif chunk.host_mask.shape[0] > n:  # no step runs where every process pads
                chunk = _truncated(chunk, n)
            # Every process plans the same calls; evaluation and prediction find the loops
            # in them from the step count (driver/evaluation.py), so the steps are all that
            # must agree.
            chunk = chunk._replace(steps=n)
        else:
            n = int(steps.min())
            if n == 0:
                self._ended = True
                raise StopIteration
            if chunk.steps > n:
                chunk = _truncated(chunk, n)
        return chunk._replace(host_mask=multihost.to_host(chunk.mask) > 0)

    def _empty_chunk(self, n: int):
        pipe = self._pipe
        if pipe.sig is None:
            raise EstimatorValueError(
                f"input_fn of process {jax.process_index()} produced no batches while other "
                "processes' did; every process needs at least one batch to know the shapes"
            )
        rows = pipe.rows_per_step  # all padding: this process's input has ended
        leaves = [np.zeros((n, rows, *s), d) for s, d in zip(pipe.sig.shapes, pipe.sig.dtypes)]
        host_mask = np.zeros((n, rows), bool)
        features, labels, mask = to_devices(pipe, leaves, host_mask, self._mesh)
        return Chunk(features, labels, mask, host_mask, 0, 0, pipe.get_state())

    def close(self) -> None:
        self._prefetch.close()


def _truncated(chunk: Chunk, n: int) -> Chunk:
    """The first ``n`` steps of a chunk (only this process's shards move)."""
    return chunk._replace(
        features=jax.tree.map(lambda x: multihost.truncate_steps(x, n), chunk.features),
        labels=jax.tree.map(lambda x: multihost.truncate_steps(x, n), chunk.labels),
        mask=multihost.truncate_steps(chunk.mask, n),
        host_mask=chunk.host_mask[:n],
        steps=min(chunk.steps, n),
    )


def synced(prefetch: Any, pipe: Any, *, fill: bool, mesh: Mesh) -> Any:
    """``prefetch`` itself in one process, else a ``SyncedChunks`` over it."""
    if not multihost.is_multiprocess():
        return prefetch
    return SyncedChunks(prefetch, pipe, fill=fill, mesh=mesh)
