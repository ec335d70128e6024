"""Programs compiled ahead, on threads, while other work runs.

A cold job pays for every program it compiles before that program's first call. Where the
arguments of a later call are known early, its program can compile meanwhile:
``AheadCall.compile_ahead`` traces, lowers and compiles it on a pool thread (XLA releases
the GIL while it compiles, so training keeps dispatching), and the call uses that compiled
executable, not a second compile of the same program by ``jit``. Compiling is deterministic,
so results do not depend on which thread compiled a program or when.

``train_and_evaluate`` uses it for the evaluation program while training runs
(``eval_call_specs``: the eval input is taken to have the training input's shapes per
example, at ``eval_batch_size``; when it turns out otherwise the compiled program is
unused, and the evaluation compiles its own as before). The pool has two threads: a
second compile overlaps a first where cores allow it, and on two cores no more threads
compete with the job than it has programs to compile.

Example:
  >>> loop = AheadCall(jax.jit(f), steps_of=lambda args: args[0].shape[0])
  >>> loop.compile_ahead(4, (spec,))        # returns at once; compiles on a thread
  >>> loop(x)                               # x.shape[0] == 4: the program compiled ahead
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..data import plan
from ..parallel.mesh import DATA
from . import executables

log = logging.getLogger("estimator")

POOL_THREADS = 2
COMPILE_WAIT = "/estimator/compile_wait_duration"  # a JAX monitoring event: waiting for one
_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def pool() -> ThreadPoolExecutor:
    """The process's compile threads (made on first use)."""
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(
                ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix="compile-ahead")
            )
        return _POOL[0]


class AheadCall:
    """A jitted loop that runs the executable compiled ahead for a call's length, if any.

    Args:
      jitted: the ``jax.jit`` function (what runs when nothing was compiled ahead).
      steps_of: the call length of an argument tuple (read on every call: keep it cheap).
    """

    def __init__(self, jitted: Callable, steps_of: Callable[[tuple], int]):
        self._jitted, self._steps_of = jitted, steps_of
        self._ahead: dict[int, Future] = {}
        self.used_ahead: set[int] = set()  # lengths whose calls ran a program compiled ahead

    def __getattr__(self, name: str) -> Any:  # lower, trace, ... of the jitted function
        return getattr(self._jitted, name)

    def compile_ahead(
        self, steps: int, specs: tuple, *, on_done: Callable[[float], None] | None = None
    ) -> Future:
        """Starts compiling the program for calls of ``steps`` with arguments like ``specs``
        (``jax.ShapeDtypeStruct`` leaves with their shardings); ``on_done(seconds)`` runs
        once it compiled. A second request for the same length returns the first."""
        if steps in self._ahead:
            return self._ahead[steps]

        def build():
            start = time.perf_counter()
            compiled = executables.load_or_compile(self._jitted, specs)
            if on_done is not None:
                on_done(time.perf_counter() - start)
            return compiled

        future = pool().submit(build)
        self._ahead[steps] = future
        return future

    def executable(self, steps: int) -> Any:
        """The executable calls of ``steps`` ran when it was compiled ahead or loaded by its
        trace; None otherwise (then jit's own cache holds it)."""
        future = self._ahead.get(steps)
        if future is None or not future.done() or future.exception() is not None:
            return None
        return future.result()

    def __call__(self, *args):
        if not self._ahead and executables.cache_dir() is None:
            return self._jitted(*args)
        steps = self._steps_of(args)
        future = self._ahead.get(steps)
        if future is None:
            if executables.cache_dir() is None:
                return self._jitted(*args)
            # kept by its trace (a warm process lowers nothing), then run as if compiled ahead
            future = Future()
            future.set_result(executables.load_or_compile(self._jitted, args))
            self._ahead[steps] = future
        try:
            if not future.done():  # the caller waits for a compile: reported (goodput)
                start = time.perf_counter()
                future.exception()
                jax.monitoring.record_event_duration_secs(COMPILE_WAIT, time.perf_counter() - start)
            compiled = future.result()  # waits while it is still compiling
            out = compiled(*args)
        except Exception as e:  # noqa: BLE001 (jit below raises a real error again)
            # Shapes or shardings other than expected (checked before the program runs; these
            # loops donate nothing), or a trace error, which jit raises again in this thread.
            log.debug("The program compiled ahead for %d steps is not used: %s", steps, e)
            del self._ahead[steps]
            return self._jitted(*args)
        self.used_ahead.add(steps)
        return out


class ChunkSignature(NamedTuple):
    """The per-row shapes and dtypes of a chunk's input (``Signature``'s fields that
    ``eval_call_specs`` reads)."""

    treedef: Any
    shapes: tuple
    dtypes: tuple


def chunk_signature(chunk: Any) -> ChunkSignature:
    """The per-row signature of a staged chunk's ``(features, labels)``."""
    leaves, treedef = jax.tree.flatten((chunk.features, chunk.labels))
    return ChunkSignature(
        treedef, tuple(x.shape[2:] for x in leaves), tuple(np.dtype(x.dtype) for x in leaves)
    )


def first_eval_call(
    *,
    rows: int,
    row_bytes: int,
    local_replicas: int,
    budget: int,
    iterations_per_loop: int,
    steps: int | None,
    merge_loops: bool,
) -> int:
    """The length of evaluation's first planned call (as ``data/staging.py`` plans it)."""
    ipl = iterations_per_loop
    step_bytes = -(-rows // local_replicas) * (row_bytes + 4)
    sizes = {"budget": budget, "step_bytes": step_bytes, "iterations_per_loop": ipl}
    k = plan.steps_per_call(**sizes)
    merge = plan.loops_per_call(**sizes) if merge_loops else 1
    left = [steps]

    def schedule() -> int:
        if left[0] is None:
            return ipl
        n = min(ipl, left[0])
        left[0] -= n
        return n

    first = next(plan.plan_calls(schedule, k=k, exact_tail=False, merge=merge), None)
    return 0 if first is None else first.steps


def eval_call_specs(
    mesh: Mesh,
    variables: Any,
    sig: Any,
    *,
    rows: int,
    steps: int,
    rng: np.ndarray,
) -> tuple:
    """Argument specs of an EVAL loop call: ``(variables, step, rng, features, labels, mask)``
    of ``steps`` steps of ``rows`` rows with the per-row shapes of ``sig`` (an input
    signature), placed as ``driver/evaluation.py`` places them."""
    replicated = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P(None, DATA))
    leaves = [
        jax.ShapeDtypeStruct((steps, rows, *s), d, sharding=batch)
        for s, d in zip(sig.shapes, sig.dtypes)
    ]
    features, labels = jax.tree.unflatten(sig.treedef, leaves)

    def like(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

    return (
        jax.tree.map(like, variables),
        jax.ShapeDtypeStruct((), np.int32, sharding=replicated),
        jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=replicated),
        features,
        labels,
        jax.ShapeDtypeStruct((steps, rows), np.float32, sharding=batch),
    )


__all__ = [
    "AheadCall",
    "ChunkSignature",
    "chunk_signature",
    "eval_call_specs",
    "first_eval_call",
    "pool",
]
