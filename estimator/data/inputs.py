"""From input_fn to global batches: calling, checking, padding and prefetching.

The data path is one line: ``input_fn`` -> host batches -> global batch per step (per the
``InputPipelineConfig``), written with its row mask straight into a call's ``[n, rows, ...]``
buffer (``staging``) -> device arrays sharded over ``"data"``. A pooled background thread
does it for the next compiled call while the current one runs.
"""

from __future__ import annotations

import base64
import collections
import inspect
import json
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from ..core.errors import EstimatorTypeError, EstimatorValueError
from ..core.input_context import InputContext
from ..parallel import multihost
from . import structure, threads
from .layout import BatchLayout
from .single_batch import as_batches

log = logging.getLogger("estimator")

_INPUT_FN_ARGS = ("params", "config", "mode", "input_context")


def call_input_fn(
    input_fn: Callable, *, params: dict, config: Any, mode: str, input_context: InputContext
) -> Iterator:
    """Calls input_fn with the arguments it names and returns an iterator over its batches.

    One ``(features, labels)`` tuple of arrays is one batch, as TF's input_fn returned tensors
    (``single_batch``: repeated in TRAIN, once in EVAL and PREDICT).

    Raises:
      ValueError: input_fn takes no ``params`` or an unknown argument.
      TypeError: what it returned is not iterable.
    """
    if not callable(input_fn):
        raise EstimatorTypeError(f"input_fn must be callable, got {input_fn!r}")
    names = [
        p.name
        for p in inspect.signature(input_fn).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    unknown = [n for n in names if n not in _INPUT_FN_ARGS]
    if unknown:
        raise EstimatorValueError(
            f"input_fn has unexpected argument(s) {unknown}; "
            f"it may take {', '.join(_INPUT_FN_ARGS)}"
        )
    if "params" not in names:
        raise EstimatorValueError(
            "input_fn must take a 'params' argument (it carries the batch size)"
        )
    values = {"params": params, "config": config, "mode": mode, "input_context": input_context}
    data = input_fn(**{n: values[n] for n in names})
    if hasattr(data, "as_numpy_iterator"):
        data = data.as_numpy_iterator()
    if data is None:
        raise EstimatorTypeError("input_fn returned None; it must return an iterable of batches")
    single = as_batches(data, mode=mode, batch_size=params.get("batch_size"))
    if single is not None:  # one (features, labels) pair, as TF's input_fn returned tensors
        return single
    try:
        return iter(data)
    except TypeError:
        raise EstimatorTypeError(
            f"input_fn must return an iterable of batches, got {type(data).__name__}"
        ) from None


_BYTES = "__bytes_b64__"


def encode_state(state: Any) -> Any:
    """An input iterator's ``get_state()`` as a JSON value (checkpoints store it in ``meta``).

    bytes (Grain's iterators return them) become ``{"__bytes_b64__": ...}`` and numpy scalars
    Python numbers; tuples come back as lists.

    Raises:
      TypeError: the state holds something JSON cannot store, naming its type.
    """

    def default(o):
        if isinstance(o, (bytes, bytearray)):
            return {_BYTES: base64.b64encode(bytes(o)).decode("ascii")}
        if isinstance(o, np.generic):
            return o.item()
        raise EstimatorTypeError(f"{type(o).__name__} is not JSON serializable")

    try:
        return json.loads(json.dumps(state, default=default))
    except (TypeError, ValueError) as e:
        raise EstimatorTypeError(
            f"the input iterator's get_state() returned a {type(state).__name__} that cannot be "
            f"saved in a checkpoint ({e}); return JSON-serialisable values (dict, list, str, "
            "numbers, bytes), or remove get_state/set_state to fast-forward the input instead"
        ) from e


def decode_state(state: Any) -> Any:
    """The inverse of ``encode_state``."""
    if isinstance(state, dict):
        if set(state) == {_BYTES}:
            return base64.b64decode(state[_BYTES])
        return {k: decode_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [decode_state(v) for v in state]
    return state


def split_element(element: Any) -> tuple[Any, Any]:
    """``(features, labels)`` from a batch, by TF's rule: a 2-element tuple or list (a
    PyTorch DataLoader yields lists) is (features, labels); anything else is features (a
    tuple of another length gets a hint if model_fn then fails without labels)."""
    if isinstance(element, (tuple, list)) and len(element) == 2 and not _is_namedtuple(element):
        return element[0], element[1]
    return element, None


def _is_namedtuple(x: Any) -> bool:
    """A namedtuple is one structured feature, not a (features, labels) sequence."""
    return isinstance(x, tuple) and hasattr(x, "_fields")


_CANONICAL = {
    np.dtype(np.float64): np.float32,
    np.dtype(np.int64): np.int32,
    np.dtype(np.uint64): np.uint32,
}


def _canonical(x: Any, name: str = "<batch>") -> np.ndarray:
    """``x`` with 64-bit dtypes narrowed to what the devices run (float32, int32, uint32).

    64-bit integers are kept in 64-bit mode (``jax_enable_x64``); otherwise values beyond the
    32-bit range are an error naming the entry rather than a silent wrap.
    """
    x = np.asarray(x)
    target = _CANONICAL.get(x.dtype)
    if target is None:
        return x
    if x.dtype.kind in "iu":
        if jax.config.jax_enable_x64:
            return x
        _check_fits(x, np.dtype(target), name)
    return x.astype(target)


def _check_fits(x: np.ndarray, target: np.dtype, name: str) -> None:
    if not x.size:
        return
    low, high, info = x.min(), x.max(), np.iinfo(target)
    if low < info.min or high > info.max:
        raise EstimatorValueError(
            f"input batch entry {name} has {x.dtype} values outside the {target} range "
            f"(min {low}, max {high}): they would wrap silently on the devices. Map them into "
            f"{target} in input_fn (e.g. hashed ids modulo the vocabulary size), or enable "
            "64-bit mode (jax.config.update('jax_enable_x64', True)) to keep them."
        )


class Signature(NamedTuple):
    """The structure, per-row shapes and dtypes every batch of a run must have."""

    treedef: Any
    paths: tuple
    shapes: tuple  # per leaf, without the batch dimension
    dtypes: tuple


def _check_python_lists(tree: Any) -> None:
    """A Python list of numbers (or of such lists) where an array belongs: a clear error.

    JAX reads a list as a structure of separate entries, so ``{"x": [[1.0, 2.0], ...]}``
    would otherwise fail as "``['x'][0][0]`` is a scalar".
    """

    def numeric(v: Any) -> bool:
        if isinstance(v, list):
            return all(numeric(e) for e in v)
        return isinstance(v, bool | int | float | complex | np.generic)

    def visit(node: Any, path: tuple) -> None:
        if isinstance(node, list) and node and numeric(node):
            name = jax.tree_util.keystr(path) or "<batch>"
            try:
                np.asarray(node)
            except ValueError:
                raise EstimatorValueError(
                    f"input batch entry {name} is a ragged Python list (rows of different "
                    "lengths); batches must hold arrays of one shape: pad the rows to one "
                    "length (and mask the padding) in input_fn"
                ) from None
            raise EstimatorValueError(
                f"input batch entry {name} is a Python list, not an array; JAX reads a list "
                f"as separate entries: make it an array with np.asarray(...) in input_fn"
            )
        children = node.items() if isinstance(node, dict) else None
        if children is None and isinstance(node, list | tuple):
            children = enumerate(node)
        for key, child in children or ():
            entry = (
                jax.tree_util.DictKey(key)
                if isinstance(node, dict)
                else jax.tree_util.SequenceKey(key)
            )
            visit(child, (*path, entry))

    visit(tree, ())


def signature_of(tree: Any) -> Signature:
    _check_python_lists(tree)
    structure.check_row_lists(tree)
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [_canonical(x, _name(p)) for p, x in leaves_with_path]
    for (path, _), x in zip(leaves_with_path, leaves):
        if x.ndim == 0:
            raise EstimatorValueError(
                f"input batch entry {_name(path)} is a scalar; every entry needs a batch dimension"
            )
        if x.dtype.kind == "c":
            raise EstimatorTypeError(
                f"input batch entry {_name(path)} has dtype {x.dtype}; complex inputs are not "
                "supported (layers and losses need real dtypes): pass the real and imaginary "
                "parts as two float entries (np.real(x), np.imag(x)) in input_fn"
            )
        if x.dtype.kind not in "biuf":
            raise EstimatorTypeError(
                f"input batch entry {_name(path)} has dtype {x.dtype}; batches must hold numeric "
                "or bool arrays (turn strings into ids in input_fn)"
            )
    return Signature(
        treedef,
        tuple(_name(p) for p, _ in leaves_with_path),
        tuple(x.shape[1:] for x in leaves),
        tuple(x.dtype for x in leaves),
    )


def _name(path) -> str:
    return jax.tree_util.keystr(path) or "<batch>"


def conform(tree: Any, sig: Signature, *, rows: int, allow_short: bool) -> tuple[list, int]:
    """Checks one batch against the run's signature; returns (leaves, real rows).

    Dtypes that can be cast safely are converted (so nothing recompiles); others, a changed
    structure or shape, or more rows than the batch size are errors naming the entry.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if treedef != sig.treedef:
        raise EstimatorValueError(
            f"input batch structure changed: {structure.change(sig.paths, tree)}. Each "
            "batch is read by TF's rule: a 2-element tuple or list is (features, labels), "
            "anything else is features; input_fn returns an iterable of such batches, or "
            "one (features, labels) tuple of arrays"
        )
    out = []
    for x, name, shape, dtype in zip(leaves, sig.paths, sig.shapes, sig.dtypes):
        x = _canonical(x, name)
        if x.ndim == 0 or x.shape[1:] != shape:
            raise EstimatorValueError(
                f"input batch entry {name} has shape {x.shape}, expected (batch, *{shape}) "
                f"with batch {rows}"
            )
        if x.dtype != dtype:
            if not np.can_cast(x.dtype, dtype, casting="same_kind"):
                raise EstimatorTypeError(
                    f"input batch entry {name} has dtype {x.dtype}, expected {dtype}; a new dtype "
                    "would recompile the loop, so cast it in input_fn"
                )
            x = x.astype(dtype)
        out.append(x)
    n = _batch_rows(out, list(sig.paths), rows)
    if n > rows or (n < rows and not allow_short):
        raise EstimatorValueError(
            f"input batch has {n} rows, expected batch size {rows} (entry {sig.paths[0]}, "
            f"shape {out[0].shape if out else ()})"
        )
    return out, n


def _batch_rows(leaves: list, names: list[str], rows: int) -> int:
    """The rows of a batch whose entries all lead with the batch dimension.

    When the leading dimensions disagree, the batch is the one that equals the batch size
    (or, for a short final batch, the most common one), and the error names every entry that
    does not lead with it: a transposed features entry (TF's ``transpose_input``) is blamed,
    not the labels.
    """
    leading = [x.shape[0] for x in leaves]
    if len(set(leading)) <= 1:
        return leading[0] if leading else 0
    counts = collections.Counter(leading)
    batch = rows if rows in counts else max(counts, key=lambda d: (counts[d], d))
    wrong = [f"{name} (shape {x.shape})" for name, x in zip(names, leaves) if x.shape[0] != batch]
    raise EstimatorValueError(
        f"input batch entry {structure.some(wrong)} does not lead with the batch dimension: the "
        f"batch has {batch} rows (batch size {rows}) and every entry must be batch-major, "
        "shape (batch, ...). Transpose such an entry back in input_fn (e.g. TF's "
        "transpose_input layout [H, W, C, batch]) and transpose it in model_fn if the model "
        "wants it"
    )


class Chunk(NamedTuple):
    """One compiled call's input on the devices, plus what the host needs to know of it."""

    features: Any
    labels: Any
    mask: Any  # device float32 [n, global batch]
    host_mask: np.ndarray  # bool [n, global batch]
    steps: int  # real steps (batches with at least one real row)
    pulls: int  # batches taken from the input iterator
    input_state: Any = None  # the iterator's encoded get_state() right after these pulls
    loop_steps: int = 0  # the planned steps of each loop it runs (or belongs to)
    loop_ends: tuple[int, ...] = ()  # offsets (<= steps) where one of those loops ends

    @property
    def ends_loop(self) -> bool:
        """Whether its last step ends a loop of ``iterations_per_loop`` steps."""
        return bool(self.loop_ends) and self.loop_ends[-1] == self.steps


class Pipeline:
    """Turns one input_fn stream into global batches for the configured pipeline mode.

    Args:
      iterator: what input_fn returned.
      layout: the mode's ``BatchLayout`` (pulls per step, rows per pull, broadcast).
      pad: whether a short batch is padded (eval/predict) or skipped (train: a step has a
        fixed batch size, so a short batch anywhere in the stream is skipped and counted).
    """

    def __init__(
        self,
        iterator: Iterator,
        *,
        layout: BatchLayout,
        pad: bool,
    ):
        self.it = iterator
        self.layout = layout
        self.pad = pad
        self.pulls_per_step, self.rows_per_pull = layout.pulls_per_step, layout.rows_per_pull
        self.sig: Signature | None = None
        self.has_labels: bool | None = None
        self.exhausted = False
        self.pulled = 0  # batches taken from the iterator
        self.consumed = 0  # batches handed to steps (``prime`` holds the first one back)
        self._ahead: tuple[list, int] | None = None
        self.stateful = all(
            callable(getattr(iterator, m, None)) for m in ("get_state", "set_state")
        )
        self.positioned = False  # moved past earlier batches (skip or set_state)
        self.global_step = 0  # of the last step read; the trainer sets where it starts
        self.short_skipped = 0
        self._reported_short = False

    @property
    def rows_per_step(self) -> int:
        """Rows of one step's batch on this process (every replica's copy in BROADCAST)."""
        return self.rows_per_pull * self.pulls_per_step * self.layout.copies

    def step_bytes(self) -> int:
        """Bytes of one step's input on one device: a replica's rows of every entry and of
        the float32 mask. Known once a batch was read (``prime``); 0 before."""
        if self.sig is None:
            return 0
        row = sum(
            int(np.prod(s, dtype=np.int64)) * d.itemsize
            for s, d in zip(self.sig.shapes, self.sig.dtypes)
        )
        return -(-self.rows_per_step // self.layout.local_replicas) * (row + 4)

    def get_state(self) -> Any:
        """The iterator's position as JSON (see ``encode_state``); None if it has none."""
        return encode_state(self.it.get_state()) if self.stateful else None

    def set_state(self, state: Any) -> None:
        """Moves the iterator to a position ``get_state`` returned (before any pull)."""
        self.it.set_state(decode_state(state))
        self.positioned = True

    def _pull(self) -> tuple[list, int] | None:
        try:
            element = next(self.it)
        except StopIteration:
            self.exhausted = True
            return None
        self.pulled += 1
        if isinstance(element, (str, bytes)):
            raise EstimatorTypeError(
                f"input_fn's iterable yielded {element!r}, not a batch; it must yield "
                "(features, labels) or features of arrays (a dict of whole arrays iterates "
                "over its keys: yield batches instead)"
            )
        features, labels = split_element(element)
        if self.sig is None:
            self.has_labels = labels is not None
            self.sig = signature_of((features, labels))
        return conform((features, labels), self.sig, rows=self.rows_per_pull, allow_short=True)

    def _skip_short(self, rows: int) -> None:
        """A short training batch is skipped (a step has a fixed batch size) and counted:
        the first is logged, the rest once at the end (``log_short_skipped``)."""
        self.short_skipped += 1
        if self.short_skipped == 1:
            log.warning(
                "Skipping a short training batch of %d rows (batch size %d) before global step "
                "%d; short batches inside the input (e.g. each epoch's last) are skipped, not "
                "trained on, and counted once at the end.",
                rows,
                self.rows_per_pull,
                self.global_step + 1,
            )

    def log_short_skipped(self) -> None:
        """Logs, once, how many short batches were skipped after the first one logged."""
        more = self.short_skipped - 1
        if more > 0 and not self._reported_short:
            self._reported_short = True
            log.warning(
                "Skipped %d more short training batch%s (%d in all; not trained on).",
                more,
                "" if more == 1 else "es",
                self.short_skipped,
            )

    def _take(self) -> tuple[list, int] | None:
        got, self._ahead = self._ahead, None
        if got is None:
            got = self._pull()
        if got is not None:
            self.consumed += 1
        return got

    def prime(self) -> bool:
        """Reads the first batch ahead, so ``sig`` and ``step_bytes`` are known before any
        step is staged; False when the input has none. The first step still gets it."""
        if self.sig is None and self._ahead is None and not self.exhausted:
            self._ahead = self._pull()
        return self.sig is not None

    def skip(self, pulls: int) -> int:
        """Fast-forwards ``pulls`` batches; returns how many were really there."""
        done = 0
        while done < pulls and not self.exhausted:
            if self._take() is None:
                break
            done += 1
        self.positioned = self.positioned or done > 0
        return done

    def write_step(self, out: list[np.ndarray], mask: np.ndarray, i: int) -> bool:
        """Writes the next step's global batch into ``out[j][i]`` (one array per entry) and
        its row mask into ``mask[i]``, padding rows zeroed; False at the end of the input.

        In training a short batch is skipped and counted (an error when it is the first).
        """
        rows, pulls = self.rows_per_pull, self.pulls_per_step
        p, real = 0, False
        while p < pulls:
            lo = p * rows
            got = self._take()
            if got is None:
                if p == 0:
                    return False
                for buf in out:  # a partial step in PER_HOST_V2: the other replicas pad
                    buf[i, lo : pulls * rows] = 0
                mask[i, lo : pulls * rows] = False
                break
            leaves, n = got
            if n < rows and not self.pad:
                if not self.positioned and self.consumed == 1:
                    raise EstimatorValueError(
                        f"the first training batch has {n} rows, expected params['batch_size'] "
                        f"= {rows} (entry {self.sig.paths[0]}); input_fn must batch with the "
                        "batch size it is given"
                    )
                self._skip_short(n)
                continue
            for buf, x in zip(out, leaves):
                buf[i, lo : lo + n] = x
                if n < rows:
                    buf[i, lo + n : lo + rows] = 0
            mask[i, lo : lo + n] = True
            mask[i, lo + n : lo + rows] = False
            real = real or n > 0
            p += 1
        if not real:
            return False
        self.global_step += 1
        copies = self.layout.copies
        if copies > 1:  # BROADCAST: every replica gets the whole batch
            width = pulls * rows
            for buf in [*out, mask]:
                step = buf[i]
                step[width:] = np.tile(step[:width], (copies - 1,) + (1,) * (step.ndim - 1))
        return True


def to_devices(pipe: Pipeline, leaves: list, host_mask: np.ndarray, mesh: Mesh) -> tuple:
    """``(features, labels, mask)``: ``[n, rows, ...]`` host leaves (one per input entry, in
    the pipeline's signature order) and their row mask as global arrays sharded over "data"
    (each process holds only its own rows)."""
    features, labels = jax.tree.unflatten(pipe.sig.treedef, leaves)
    return multihost.global_batch((features, labels, host_mask.astype(np.float32)), mesh)


_DONE = object()


class Prefetcher:
    """Runs ``items`` (an iterator) on a pooled background thread, at most ``depth`` ahead.

    Errors raised by the producer (input_fn included) are raised in the consumer's thread with
    their original traceback. Once ``interrupt`` is set, a wait for the next item ends as the
    end of the input. ``close()`` stops the producer early and drops what it staged; the
    thread goes back to the pool (``threads``), so repeated calls start no new threads.
    """

    def __init__(
        self,
        items: Iterator,
        *,
        depth: int = 1,
        interrupt: threading.Event | None = None,
        on_close: Callable[[], None] | None = None,
    ):
        self._items = items
        self._on_close = on_close  # e.g. the pipeline's end-of-input summary
        self.interrupt = interrupt  # once set, a wait for the next item ends as the end
        self.interrupted = False
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._done = threads.run_in_thread(self._run, name="input-prefetch")

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self):
        try:
            for item in self._items:
                if not self._put(item):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(e)
            return
        finally:
            self._items = None  # the generator and its buffers go with this task
        self._put(_DONE)

    def __iter__(self):
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        item = self._get()
        if item is _DONE:
            self._finished = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        return item

    def _get(self):
        """The next item; a wait polls ``interrupt`` (a stalled input must not hold a stop)."""
        while True:
            try:
                return self._queue.get(timeout=0.1)
            except queue.Empty:
                if self.interrupt is not None and self.interrupt.is_set():
                    self.interrupted = True
                    return _DONE

    def close(self):
        """Stops the producer and drops what it staged; waits for it a little (not for an
        input stuck in a wait)."""
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        stopping = self.interrupt is not None and self.interrupt.is_set()
        self._done.wait(timeout=0.5 if stopping else 10)
        if self._on_close is not None:
            self._on_close()
