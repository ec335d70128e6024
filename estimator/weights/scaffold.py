"""Fresh-start initialisation: ``Scaffold(init_fn)``, ``init_from_checkpoint``, warm start.

All of these run only when training starts with no checkpoint in ``model_dir``; a resumed
run never re-initialises. They see and return every collection (``params`` and e.g.
``batch_stats``) as numpy, named ``module/.../leaf`` for params and
``collection/module/.../leaf`` for other collections. ``warm_start_from`` is applied first,
then every ``init_from_checkpoint`` called directly inside model_fn (TF's non-TPU idiom, as
BERT writes it), then every one called inside ``scaffold_fn`` (BERT's TPU idiom:
``def tpu_scaffold(): init_from_checkpoint(ckpt, amap); return Scaffold()``), then the
spec's ``Scaffold.init_fn``. ``Scaffold(saver=Saver(var_list))`` says instead what
evaluate, predict and export read (``estimator/core/saver.py``). Restores log (INFO, logger
``estimator``) which variables matched and which kept their initial values.

Example:
  >>> def scaffold_fn():
  ...     return estimator.Scaffold(
  ...         init_fn=estimator.init_from_checkpoint("/runs/pretrain", {"encoder/": "encoder/"}))
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..core import context
from ..core.errors import EstimatorTypeError, EstimatorValueError
from ..core.saver import Saver
from ..core.spec import ModeKeys
from ..engine.traced import check_no_traced_values, traced_value_guard
from ..io.checkpoint_read import read_variables
from ..io.variables import flatten, unflatten_into

log = logging.getLogger("estimator")
_LOCAL = threading.local()  # the init_from_checkpoint calls of the scaffold_fn running now


@dataclasses.dataclass
class Scaffold:
    """TF's Scaffold, reduced to what JAX needs.

    Args:
      init_fn: ``init_fn(variables) -> variables``, run on a fresh training start.
      saver: an ``estimator.Saver`` whose ``var_list`` says which checkpoint values
        evaluate, predict and export read (TF's EMA evaluation); training ignores it.
    """

    init_fn: Callable[[dict], dict] | None = None
    saver: Saver | None = None

    def __post_init__(self):
        if self.init_fn is not None and not callable(self.init_fn):
            raise EstimatorTypeError(f"Scaffold init_fn must be callable, got {self.init_fn!r}")
        if self.saver is not None and not isinstance(self.saver, Saver):
            raise EstimatorTypeError(
                f"Scaffold saver must be an estimator.Saver, got {type(self.saver).__name__}"
            )


@dataclasses.dataclass(frozen=True)
class WarmStartSettings:
    """Which variables ``warm_start_from`` restores (TF's ``WarmStartSettings``).

    Args:
      ckpt_to_initialize_from: a checkpoint step directory or a model_dir (its latest).
      vars_to_warm_start: a regex matched (``re.match``) against variable names; the
        default covers every collection, batch statistics included (TF's default covered
        trainable ones only).

    Example:
      >>> settings = WarmStartSettings("/runs/previous", vars_to_warm_start=r"encoder/")
    """

    ckpt_to_initialize_from: str
    vars_to_warm_start: str = ".*"


def _restore_matching(
    variables: dict, source: dict, mapping: Callable[[str], str | None], what: str
) -> dict:
    current = flatten(variables)
    updates, matched = {}, []
    for name, value in current.items():
        src = mapping(name)
        if src is None or src not in source:
            continue
        got = np.asarray(source[src])
        if got.shape != np.shape(value):
            raise EstimatorValueError(
                f"{what}: variable {name!r} has shape {np.shape(value)} but checkpoint "
                f"variable {src!r} has shape {got.shape}"
            )
        updates[name] = got.astype(np.asarray(value).dtype)
        matched.append(name)
    unmatched = sorted(set(current) - set(matched))
    log.info("%s: restored %d variables: %s", what, len(matched), sorted(matched))
    if unmatched:
        log.info(
            "%s: %d variables not restored (kept their initial values): %s",
            what,
            len(unmatched),
            unmatched,
        )
    return unflatten_into(variables, updates)


def init_from_checkpoint(path: str, assignment_map: dict[str, str]) -> Callable[[dict], dict]:
    """An ``init_fn`` restoring variables from a checkpoint by name (TF's semantics).

    Args:
      path: a checkpoint step directory or a model_dir (its latest checkpoint).
      assignment_map: ``{checkpoint_name_or_prefix: current_name_or_prefix}``; prefixes end
        with ``/``, ``"/"`` is the root (``{"/": "/"}`` maps every variable to the same
        name), other entries name one variable; the longest matching prefix wins.

    Returns:
      ``init_fn(variables) -> variables`` for ``Scaffold``; it raises ValueError naming a
      variable whose shape differs from the checkpoint's.

    Called directly inside model_fn in TRAIN mode (TF's idiom, no scaffold), it also
    registers itself: the restore is applied on a fresh start exactly as from ``scaffold_fn``
    (after warm start, before the scaffold's ``init_fn``). In EVAL/PREDICT the variables come
    from the estimator's own checkpoint, so nothing is registered there (as in TF).

    Example:
      >>> init_fn = init_from_checkpoint("/runs/pretrain", {"encoder/": "encoder/"})
      >>> def model_fn(features, labels, mode, params):
      ...     init_from_checkpoint(params["init_checkpoint"], {"bert/": "bert/"})  # TF's form
    """
    if not isinstance(assignment_map, dict) or not assignment_map:
        raise EstimatorValueError("assignment_map must be a non-empty dict {checkpoint_name: name}")

    def mapping(name: str) -> str | None:
        return _source_name(name, assignment_map)

    def init_fn(variables: dict) -> dict:
        return _restore_matching(
            variables, read_variables(path), mapping, f"init_from_checkpoint({path})"
        )

    collected = getattr(_LOCAL, "calls", None)
    ctx = context.current()
    if collected is not None:  # called inside scaffold_fn (BERT's TPU form)
        collected.append(init_fn)
    elif ctx is not None and ctx.mode == ModeKeys.TRAIN:  # called inside model_fn
        ctx.notes.setdefault(IN_MODEL_FN, []).append(init_fn)
    return init_fn


IN_MODEL_FN = "init_from_checkpoint"  # the ModelFn note listing in-model_fn init functions


def _source_name(name: str, assignment_map: dict[str, str]) -> str | None:
    """The checkpoint name of current variable ``name`` (the longest matching entry wins)."""
    best, best_len = None, -1
    for src, dst in assignment_map.items():
        src_scope = "" if src == "/" else src
        dst_scope = "" if dst == "/" else dst
        if dst_scope == "" or dst_scope.endswith("/"):  # scope -> scope
            if name.startswith(dst_scope) and len(dst_scope) > best_len:
                best, best_len = src_scope + name[len(dst_scope) :], len(dst_scope)
        elif name == dst:  # one variable
            return src
    return best


def _warm_start_fn(setting: Any) -> Callable[[dict], dict]:
    if isinstance(setting, str) or hasattr(setting, "__fspath__"):
        setting = WarmStartSettings(str(setting))
    if not isinstance(setting, WarmStartSettings):
        raise EstimatorTypeError(
            f"warm_start_from must be a path or WarmStartSettings, got {type(setting).__name__}"
        )
    pattern = re.compile(setting.vars_to_warm_start)

    def init_fn(variables: dict) -> dict:
        source = read_variables(setting.ckpt_to_initialize_from)
        return _restore_matching(
            variables,
            source,
            lambda n: n if pattern.match(n) else None,
            f"warm_start_from({setting.ckpt_to_initialize_from})",
        )

    return init_fn


@contextlib.contextmanager
def _collecting(calls: list):
    """Collects the ``init_from_checkpoint`` calls made while scaffold_fn runs."""
    before = getattr(_LOCAL, "calls", None)
    _LOCAL.calls = calls
    try:
        yield
    finally:
        _LOCAL.calls = before


def _call_scaffold_fn(scaffold_fn: Callable) -> tuple[Scaffold, list[Callable]]:
    """The Scaffold scaffold_fn returns, and the ``init_from_checkpoint`` functions it made
    (TF's TPU idiom calls ``init_from_checkpoint`` there and returns ``Scaffold()``)."""
    check_no_traced_values(scaffold_fn, "scaffold_fn")
    calls: list[Callable] = []
    with traced_value_guard("scaffold_fn"), _collecting(calls):
        scaffold = scaffold_fn()
    if not isinstance(scaffold, Scaffold):
        raise EstimatorValueError(
            f"scaffold_fn must return an estimator.Scaffold, got {scaffold!r}"
        )
    return scaffold, calls


def saver_sources(scaffold_fn: Callable | None) -> dict[str, str] | None:
    """``{model variable: checkpoint name}`` of the ``Scaffold.saver`` an EVAL/PREDICT
    spec's ``scaffold_fn`` returns; None when there is no saver or it maps every variable to
    its own name. The ``init_from_checkpoint`` calls of that scaffold_fn do nothing there
    (the variables come from the estimator's checkpoint, as in TF)."""
    if scaffold_fn is None:
        return None
    scaffold, _ = _call_scaffold_fn(scaffold_fn)
    if scaffold.saver is None or scaffold.saver.sources is None:
        return None
    sources = scaffold.saver.sources
    return None if all(k == v for k, v in sources.items()) else dict(sources)


def fresh_init_fn(
    spec: Any, warm_start_from: Any = None, *, in_model_fn: Sequence[Callable] = ()
) -> Callable[[dict], dict] | None:
    """Warm start, then the ``init_from_checkpoint`` calls made inside model_fn
    (``in_model_fn``), then those made inside the TRAIN spec's scaffold_fn, then its
    scaffold's ``init_fn``, composed; None when none is set. ``warm_start_from`` is the
    estimator's argument (a path or ``WarmStartSettings``)."""
    fns = []
    if warm_start_from is not None:
        fns.append(_warm_start_fn(warm_start_from))
    fns.extend(in_model_fn)
    scaffold_fn = spec.scaffold_fn
    if scaffold_fn is not None:
        scaffold, calls = _call_scaffold_fn(scaffold_fn)
        fns.extend(calls)
        if scaffold.init_fn is not None:
            check_no_traced_values(scaffold.init_fn, "Scaffold.init_fn")
            fns.append(scaffold.init_fn)
    if not fns:
        return None

    def init_fn(variables: dict) -> dict:
        for fn in fns:
            with traced_value_guard("Scaffold.init_fn"):
                variables = fn(variables)
            if not isinstance(variables, dict):
                raise EstimatorTypeError("Scaffold.init_fn must return the variables dict")
        return variables

    return init_fn
