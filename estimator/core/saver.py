"""``Saver(var_list)``: which checkpoint values evaluate, predict and export read (TF's Saver).

A TF program evaluates other weights than the ones it trains by giving its evaluation
scaffold a Saver whose ``var_list`` maps checkpoint names onto model variables; EfficientNet
and MnasNet evaluate their moving averages this way::

    ema = estimator.ExponentialMovingAverage(decay=0.9999)
    def scaffold_fn():
        return estimator.Scaffold(saver=estimator.Saver(ema.variables_to_restore()))

Here the estimator writes every checkpoint itself, so a Saver only says what to *read*: in
EVAL and PREDICT (and so ``export_saved_model``) each model variable the mapping names is
restored from the checkpoint value stored under its checkpoint name; a variable it does not
name is restored from its own name. Training ignores the Saver, as TF's train path restores
everything. Names are the ones ``est.get_variable_names()`` and ``estimator.list_variables``
show (``dense/kernel``; a TF ``:0`` suffix is dropped).

Example:
  >>> saver = Saver({"dense/kernel/ExponentialMovingAverage": "dense/kernel"})
  >>> saver.sources
  {'dense/kernel': 'dense/kernel/ExponentialMovingAverage'}
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from .errors import EstimatorRuntimeError, EstimatorTypeError, EstimatorValueError

log = logging.getLogger("estimator")

# TF's other Saver arguments: how TF wrote its checkpoint files. The estimator writes its own
# (RunConfig.keep_checkpoint_max keeps them), so these mean nothing here.
_TF_ONLY = (
    "reshape",
    "sharded",
    "max_to_keep",
    "keep_checkpoint_every_n_hours",
    "name",
    "restore_sequentially",
    "saver_def",
    "builder",
    "defer_build",
    "allow_empty",
    "write_version",
    "pad_step_number",
    "save_relative_paths",
    "filename",
)
_WARNED: set[str] = set()


def variable_name(var: Any, what: str = "var_list") -> str:
    """A model variable's name from a str or an object with ``.name`` (TF's ``v.name``,
    ``estimator.trainable_variables()``'s entries), without TF's ``:0`` suffix."""
    name = getattr(var, "name", var)
    if not isinstance(name, str) or not name:
        raise EstimatorTypeError(
            f"{what} entries must be variable names (str) or variables with a .name, got {var!r}"
        )
    return re.sub(r":\d+$", "", name)


def _sources(var_list: Any) -> dict[str, str] | None:
    """``{model variable name: checkpoint name}`` of TF's var_list forms."""
    if var_list is None:
        return None
    if isinstance(var_list, Mapping):
        out: dict[str, str] = {}
        for ckpt_name, var in var_list.items():
            if not isinstance(ckpt_name, str) or not ckpt_name:
                raise EstimatorTypeError(
                    f"Saver var_list keys must be checkpoint names (str), got {ckpt_name!r}"
                )
            name = variable_name(var, "Saver var_list")
            if name in out:
                raise EstimatorValueError(
                    f"Saver var_list restores variable {name!r} twice (from {out[name]!r} and "
                    f"{ckpt_name!r})"
                )
            out[name] = re.sub(r":\d+$", "", ckpt_name)
        return out
    if isinstance(var_list, (list, tuple, set, frozenset)):
        names = [variable_name(v, "Saver var_list") for v in var_list]
        return {n: n for n in names}
    raise EstimatorTypeError(
        "Saver var_list must be a dict {checkpoint_name: variable} or a list of variables, "
        f"got {type(var_list).__name__}"
    )


class Saver:
    """TF's ``tf.train.Saver``, as far as a Scaffold's saver means something here: the
    mapping evaluate, predict and export restore through.

    Args:
      var_list: ``{checkpoint_name: variable}`` (a variable is its name, e.g.
        ``"dense/kernel"``, or an object with ``.name``), a list of variables (each
        restored from its own name), or None (every variable from its own name).
      **tf_only: TF's other Saver arguments (``max_to_keep``, ``sharded``, ...), accepted
        with one warning each: the estimator writes its checkpoints itself.

    Example:
      >>> estimator.Scaffold(saver=estimator.Saver(ema.variables_to_restore()))
    """

    def __init__(self, var_list: Any = None, **tf_only: Any):
        unknown = sorted(set(tf_only) - set(_TF_ONLY))
        if unknown:
            raise EstimatorTypeError(f"Saver got unexpected argument(s): {', '.join(unknown)}")
        for name in sorted(tf_only):
            if name not in _WARNED:
                _WARNED.add(name)
                log.warning(
                    "Saver(%s=...) ignored: the estimator writes its own checkpoints "
                    "(RunConfig.keep_checkpoint_max, save_checkpoints_steps)",
                    name,
                )
        self.var_list = var_list
        self.sources = _sources(var_list)

    def save(self, *args: Any, **kwargs: Any) -> None:
        raise EstimatorRuntimeError(
            "Saver.save has no meaning here: the estimator writes every checkpoint "
            "(RunConfig.save_checkpoints_steps / save_checkpoints_secs)"
        )

    def restore(self, *args: Any, **kwargs: Any) -> None:
        raise EstimatorRuntimeError(
            "Saver.restore has no meaning here: pass the Saver as Scaffold(saver=...) from "
            "scaffold_fn, and evaluate/predict/export restore through it"
        )

    def __repr__(self) -> str:
        return f"Saver({self.var_list!r})"


__all__ = ["Saver", "variable_name"]
