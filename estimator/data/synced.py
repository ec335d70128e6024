"""Input chunks agreed across processes, so every process runs the same loops."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ..core.errors import EstimatorValueError
from ..parallel import multihost
from .inputs import Chunk, to_devices
from .plan import MAX_LOOPS_PER_CALL


class SyncedChunks:
    """The prefetcher's chunks, agreed across processes so all run the same loops.

    Each process's input may end at a different point. For evaluation and prediction
    (``pads``) the calls go on while any process has rows; a process whose input ended
    contributes all-padding steps, and a call runs only the steps where some process has
    rows. Every process plans the same calls, so the loop ends a call carries are taken from
    a process that still reads and cut to the steps that run. For training the loop length
    is the shortest process's, and training ends when any input ends. The host mask becomes
    the global one, matching the global arrays the loops return.
    """

    def __init__(self, prefetch: Any, pipe: Any, *, pads: bool, mesh: Mesh):
        self._prefetch, self._pipe, self._pads, self._mesh = prefetch, pipe, pads, mesh
        self._ended = False

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        chunk = None if self._ended else next(self._prefetch, None)
        self._ended = chunk is None
        if self._pads:
            chunk = self._padded(chunk)
        else:
            local = 0 if chunk is None else chunk.steps
            n = int(multihost.gather(np.array([local], np.int64))[:, 0].min())
            if n == 0:
                self._ended = True
                raise StopIteration
            if chunk.steps > n:
                chunk = _truncated(chunk, n)
        return chunk._replace(host_mask=multihost.to_host(chunk.mask) > 0)

    def _padded(self, chunk):
        """Evaluation and prediction: the call with the most real steps of any process, its
        loop ends from a process whose input has not ended."""
        row = np.full(2 + MAX_LOOPS_PER_CALL, -1, np.int64)  # steps, loop steps, loop ends
        row[0] = 0
        if chunk is not None:
            row[:2] = chunk.steps, chunk.loop_steps
            row[2 : 2 + len(chunk.loop_ends)] = chunk.loop_ends
        rows = multihost.gather(row)
        n = int(rows[:, 0].max())
        if not n:
            raise StopIteration
        agreed = rows[int(rows[:, 0].argmax())]
        if chunk is None:
            chunk = self._empty_chunk(n)
        elif chunk.host_mask.shape[0] > n:  # no step runs where every process pads
            chunk = _truncated(chunk, n)
        ends = tuple(int(e) for e in agreed[2:] if 0 < e <= n)
        return chunk._replace(steps=n, loop_steps=int(agreed[1]), loop_ends=ends)

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
        return Chunk(
            features, labels, mask, host_mask, steps=0, pulls=0, input_state=pipe.get_state()
        )

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


def synced(prefetch: Any, pipe: Any, *, pads: bool, mesh: Mesh) -> Any:
    """``prefetch`` itself in one process, else a ``SyncedChunks`` over it."""
    if not multihost.is_multiprocess():
        return prefetch
    return SyncedChunks(prefetch, pipe, pads=pads, mesh=mesh)
