"""Running a loop's compiled calls back to back: the host one call behind the devices.

The input side delivers a stream of chunks, one per compiled call (see ``data/plan.py``),
each marked with whether it ends its loop of ``iterations_per_loop`` steps. ``loops_of``
groups them into loops without staging a loop's input ahead of its calls; ``dispatch`` runs
the calls of one loop, fetching a call's outputs only once the next call is queued.

Example:
  >>> from typing import NamedTuple
  >>> class C(NamedTuple):
  ...     steps: int
  ...     ends_loop: bool
  ...     loop_steps: int = 3
  ...     features: object = None
  ...     labels: object = None
  ...     mask: object = None
  >>> stream = iter([C(2, False), C(1, True), C(2, True)])
  >>> [[c.steps for c in loop] for _, loop in loops_of(stream)]
  [[2, 1], [2]]
  >>> [(c.steps, out) for c, out in dispatch([C(2, False), C(1, True)],
  ...                                         launch=lambda c: c.steps * 10, fetch=str)]
  [(2, '20'), (1, '10')]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from ..cluster import progress


def loops_of(chunks: Iterator, first: Any = None) -> Iterator[tuple[int, Iterator]]:
    """Groups a stream of chunks (each with ``ends_loop``) into loops, lazily.

    Yields ``(planned steps of the loop, iterator over its chunks)`` per loop. The chunks
    are taken from ``chunks`` only as the caller asks for them, so a loop's input is never
    all staged at once. Consume a loop before asking for the next one. ``first`` is a chunk
    already taken from the stream.
    """
    head = [first]
    del first  # only ``head`` holds it, so it goes once dispatched

    def one_loop() -> Iterator:
        while True:
            chunk, head[0] = head[0], None
            if chunk is None:
                chunk = next(chunks, None)
            if chunk is None:
                return
            yield chunk
            if chunk.ends_loop:
                return

    while True:
        if head[0] is None:
            head[0] = next(chunks, None)
            if head[0] is None:
                return
        yield head[0].loop_steps, one_loop()


def dispatch(
    calls: Iterable,
    *,
    launch: Callable[[Any], Any],
    fetch: Callable[[Any], Any],
    ahead: bool = True,
) -> Iterator[tuple[Any, Any]]:
    """Runs each call; yields ``(chunk, fetched outputs)`` in order, one call behind.

    ``launch(chunk)`` dispatches a compiled call (asynchronously) and returns its device
    outputs; ``fetch(outputs)`` copies them to the host, which waits for that call. Call
    ``i`` is fetched only once call ``i + 1`` is queued, so the devices have work while the
    host copies, and at most two calls and their inputs are in flight (XLA:CPU aborts with
    many queued collective programs). With ``ahead=False`` call ``i`` is fetched (and the
    consumer has seen it) before call ``i + 1`` is launched: what the consumer drops then
    (a train call's input state kept for a replay) is freed before the next call allocates
    its outputs. The chunks yielded no longer hold their device input: ``features``,
    ``labels`` and ``mask`` become ``InputShape``s of it.
    """
    pending = None

    def hand_over() -> tuple[Any, Any]:
        # Takes the pending call out of the generator's frame: once the consumer drops
        # what it is handed, nothing here keeps it alive.
        nonlocal pending
        (done, out), pending = pending, None
        return done, fetch(out)

    # Phases marked so the stall watchdog can say what a stuck process was doing.
    for chunk in progress.each(calls, "input", then="step"):
        if not ahead and pending is not None:
            yield hand_over()
        out = launch(chunk)
        chunk = chunk._replace(**{k: _shapes(getattr(chunk, k)) for k in _INPUTS})
        if pending is not None:
            yield hand_over()
        pending, out = (chunk, out), None
    if pending is not None:
        yield hand_over()


_INPUTS = ("features", "labels", "mask")


class InputShape:
    """What a dispatched call's input array was, without its data (a pytree leaf)."""

    __slots__ = ("dtype", "shape", "sharding")

    def __init__(self, shape: tuple[int, ...], dtype: Any, sharding: Any):
        self.shape, self.dtype, self.sharding = shape, dtype, sharding


def _shapes(tree: Any) -> Any:
    # Not jax.ShapeDtypeStruct: its validation cost a visible share of a short evaluate.
    return jax.tree.map(lambda x: InputShape(x.shape, x.dtype, x.sharding), tree)


def concat_steps(parts: list) -> Any:
    """Per-call outputs ``[k_i, ...]`` (host pytrees) joined into one loop's ``[n, ...]``."""
    if len(parts) == 1:
        return parts[0]
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
