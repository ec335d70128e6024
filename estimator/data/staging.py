"""Staging a pipeline's steps for the compiled calls: one host buffer per call, bounded input.

Each compiled call's steps are written straight into one ``[n, rows, ...]`` host buffer per
input entry, allocated for that call (no per-batch concatenation, no stacking), and
transferred to the devices sharded over ``"data"``; the stager keeps no reference to it
afterwards (on CPU the device arrays may alias it, so it is never reused). ``n`` is at most
``k``, which comes from ``TPUConfig.max_staged_input_bytes`` (see ``data/plan.py``), so
neither host nor device input grows with ``iterations_per_loop``.

When the input ends inside a call, the steps read so far run as whole loops and then calls
of power-of-two lengths (one process) so no compiled step sees only padding and the programs
stay few, or, in evaluation and prediction where that costs less (``engine/tails.py``), as
the planned call with its last steps padding; with
several processes, whose inputs may end at different steps, the call is padded to its
planned length and the processes agree on its real steps (``SyncedChunks``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
from jax.sharding import Mesh

from . import plan
from .inputs import Chunk, Pipeline, to_devices
from .layout import LoopPolicy


def aligned_empty(shape: tuple[int, ...], dtype, align: int = 64) -> np.ndarray:
    """``np.empty(shape, dtype)`` starting on an ``align``-byte boundary.

    XLA:CPU places such a host array on a CPU device without copying it (and on every device
    of a replicated placement, as one shared buffer); numpy's own allocations are 16-byte
    aligned, so they are copied.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class Stager:
    """Reads planned calls from a pipeline into host buffers and onto the devices.

    Args:
      pipe: the pipeline (its first batch already read: ``pipe.prime()``).
      mesh: the device mesh; inputs are sharded over ``"data"``.
      policy: the mode's ``LoopPolicy``: whether a call the input cut short runs as calls of
        its real steps (whole loops of ``loop`` steps, then powers of two) or is padded to
        its planned length.
      loop: ``iterations_per_loop``.
      pad_short: where the policy pads (eval, predict), ``pad_short(real, planned)`` may
        choose the padded call for a call the input cut short (``engine/tails.py``:
        whichever costs less).
    """

    def __init__(
        self,
        pipe: Pipeline,
        mesh: Mesh,
        *,
        policy: LoopPolicy,
        loop: int,
        pad_short: Callable[[int, int], bool] | None = None,
    ):
        self._pipe, self._mesh, self._policy, self._loop = pipe, mesh, policy, loop
        self._choose_pad = pad_short if policy.pads else None
        self.ended = False  # the input ended inside (or before) the last call read

    def read(self, call: plan.Call) -> list[Chunk]:
        """The chunks of one planned call: one, several when the input ended inside it, or
        none when it had already ended."""
        pipe, n = self._pipe, call.steps
        rows, sig = pipe.rows_per_step, pipe.sig
        bufs = [aligned_empty((n, rows, *s), d) for s, d in zip(sig.shapes, sig.dtypes)]
        mask = np.empty((n, rows), bool)
        before, after = pipe.consumed, []
        real = 0
        while real < n and pipe.write_step(bufs, mask, real):
            real += 1
            after.append(pipe.consumed)
        ended = self.ended = real < n
        if real == 0:
            return []
        choose = self._choose_pad
        if ended and (self._policy.pad_short or (choose is not None and choose(real, n))):
            for buf in bufs:
                buf[real:n] = 0
            mask[real:n] = False
            segments = [(0, n, real)]
        elif ended and self._policy.split_short:
            sizes = plan.split_steps(real, self._loop)
            starts = np.cumsum([0, *sizes[:-1]])
            segments = [(int(a), s, s) for a, s in zip(starts, sizes)]
        else:
            segments = [(0, real, real)]
        state = pipe.get_state()
        chunks = []
        for a, length, steps in segments:
            pulls = after[a + steps - 1] - (after[a - 1] if a else before)
            leaves = [buf[a : a + length] for buf in bufs]
            # The loop ends among this segment's real steps, as offsets in it.
            ends = tuple(e - a for e in call.loop_ends if a < e <= a + steps)
            chunks.append(
                self._transfer(leaves, mask[a : a + length], steps, pulls, state, call, ends)
            )
        return chunks

    def _transfer(self, leaves, host_mask, steps, pulls, state, call, ends) -> Chunk:
        features, labels, mask = to_devices(self._pipe, leaves, host_mask, self._mesh)
        return Chunk(
            features,
            labels,
            mask,
            host_mask,
            steps=steps,
            pulls=pulls,
            input_state=state,
            loop_steps=call.loop_steps,
            loop_ends=ends,
        )


def stream_calls(
    pipe: Pipeline,
    *,
    mesh: Mesh,
    next_loop: Callable[[], int],
    policy: LoopPolicy,
    iterations_per_loop: int,
    budget: int,
    skip: int = 0,
    on_skip_short: Callable[[int], None] | None = None,
    pad_short: Callable[[int, int], bool] | None = None,
) -> Iterator[Chunk]:
    """The chunks of every planned call, in order (run it on the prefetch thread).

    ``next_loop()`` gives each loop's steps (<= 0 ends); ``policy`` (the mode's
    ``LoopPolicy``) says how calls are cut and whether one may run several whole loops that
    fit the budget (evaluation: ``plan.loops_per_call``); ``skip`` batches are fast-forwarded
    first (``on_skip_short(skip)`` is called when the input ends before). ``pad_short``
    chooses how a call the input cut short runs (``Stager``).
    """
    if skip and pipe.skip(skip) < skip and on_skip_short is not None:
        on_skip_short(skip)
    if not pipe.prime():
        return
    sizes = {
        "budget": budget,
        "step_bytes": pipe.step_bytes(),
        "iterations_per_loop": iterations_per_loop,
    }
    k = plan.steps_per_call(**sizes)
    merge = plan.loops_per_call(**sizes) if policy.merge_loops else 1
    stager = Stager(pipe, mesh, policy=policy, loop=iterations_per_loop, pad_short=pad_short)
    calls = plan.plan_calls(next_loop, k=k, exact_tail=policy.exact_tail, merge=merge)
    for call in calls:
        yield from stager.read(call)
        if stager.ended:
            return
