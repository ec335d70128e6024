"""Exporters: ``EvalSpec(exporters=...)`` exports after evaluations (TF's ``tf.estimator``'s).

``train_and_evaluate`` calls each exporter after every evaluation, with the evaluated
checkpoint and its results; an export is ``est.export_saved_model`` into
``model_dir/export/<name>/<version>/`` (a TF SavedModel when TensorFlow is installed, the
portable export in ``assets.extra/`` always; see ``io/export.py``).

- ``LatestExporter`` exports after every evaluation, keeping the newest ``exports_to_keep``.
- ``BestExporter`` exports when ``compare_fn(best_eval_result, current_eval_result)`` says
  the evaluation beats the best so far (TF's default: a lower ``loss``), keeping the newest
  ``exports_to_keep`` of those: the best model is always the newest export. The best so far
  starts from the evaluations already in ``event_file_pattern``'s event files (a restarted
  job keeps its best), earlier steps only.
- ``FinalExporter`` exports once, after the final evaluation.

This is what replaces copying the best ``model.ckpt-N.*`` files aside (EfficientNet's
``archive_ckpt``): checkpoints here are directories, and the export holds the weights and
the serving computation together. An export that fails raises: ``train_and_evaluate``
stops with its error rather than training on without the model it was asked to keep.

Example:
  >>> exporter = estimator.BestExporter(
  ...     name="best", serving_input_receiver_fn=serving_input_fn, exports_to_keep=2)
  >>> estimator.train_and_evaluate(
  ...     est, train_spec, estimator.EvalSpec(eval_input_fn, exporters=[exporter]))
"""

from __future__ import annotations

import abc
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax

from hooks import event_reader

from . import storage
from .core.errors import EstimatorRuntimeError, EstimatorTypeError, EstimatorValueError
from .io.export import export_versions

log = logging.getLogger("estimator")


class Exporter(abc.ABC):
    """TF's ``tf.estimator.Exporter``: ``export(...)`` after an evaluation.

    Subclass it for a custom exporter; ``name`` names ``model_dir/export/<name>``.
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The exporter's directory name under ``model_dir/export``."""

    @abc.abstractmethod
    def export(
        self,
        estimator: Any,
        export_path: str,
        checkpoint_path: str | None,
        eval_result: dict,
        is_the_final_export: bool,
    ) -> str | None:
        """Exports (or not) after one evaluation; returns the export directory or None."""


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or os.sep in name or name in (".", ".."):
        raise EstimatorValueError(f"exporter name must be a non-empty directory name, got {name!r}")
    return name


def _check_keep(exports_to_keep: Any) -> int | None:
    if exports_to_keep is None:
        return None
    if isinstance(exports_to_keep, bool) or not isinstance(exports_to_keep, int):
        raise EstimatorTypeError(f"exports_to_keep must be an int or None, got {exports_to_keep!r}")
    if exports_to_keep <= 0:
        raise EstimatorValueError(
            f"exports_to_keep, if provided, must be a positive number, got {exports_to_keep}"
        )
    return exports_to_keep


class _SavedModelExporter(Exporter):
    """Exports with ``est.export_saved_model`` and copies ``assets_extra`` beside it."""

    def __init__(
        self,
        name: str,
        serving_input_receiver_fn: Callable,
        assets_extra: Mapping[str, str] | None = None,
        as_text: bool = False,
    ):
        self._name = _check_name(name)
        if not callable(serving_input_receiver_fn):
            raise EstimatorTypeError(
                f"{type(self).__name__}({name!r}) needs a callable serving_input_receiver_fn, "
                f"got {serving_input_receiver_fn!r}"
            )
        if assets_extra is not None:
            if not isinstance(assets_extra, Mapping):
                raise EstimatorTypeError(
                    f"assets_extra must be a dict {{destination: source path}}, got "
                    f"{type(assets_extra).__name__}"
                )
            for dest, src in assets_extra.items():
                if not isinstance(dest, str) or os.path.isabs(dest) or ".." in dest.split("/"):
                    raise EstimatorValueError(
                        f"assets_extra destination {dest!r} must be a relative path"
                    )
                if not os.path.isfile(src):
                    raise EstimatorValueError(f"assets_extra source {src!r} is not a file")
        if as_text:
            log.warning(
                "%s(%r): as_text=True ignored: the TF SavedModel is written as a binary "
                "saved_model.pb, the portable export as JSON and StableHLO",
                type(self).__name__,
                name,
            )
        self._serving_input_receiver_fn = serving_input_receiver_fn
        self._assets_extra = dict(assets_extra or {})

    @property
    def name(self) -> str:
        return self._name

    def _export(self, estimator: Any, export_path: str, checkpoint_path: str | None) -> str:
        path = estimator.export_saved_model(
            export_path, self._serving_input_receiver_fn, checkpoint_path=checkpoint_path
        )
        if path and self._assets_extra:  # TF's place for them: <export>/assets.extra/<dest>
            for dest, src in self._assets_extra.items():
                target = storage.join(path, "assets.extra", *dest.split("/"))
                storage.makedirs(storage.dirname(target))
                with open(src, "rb") as f:
                    storage.write_bytes(target, f.read())
        log.info("%s %r exported %s", type(self).__name__, self._name, path)
        return path


def garbage_collect_exports(export_path: str, exports_to_keep: int | None) -> list[str]:
    """Deletes all but the newest ``exports_to_keep`` version directories of an exporter
    (TF's rule; the version is the directory's number); returns the deleted ones."""
    if exports_to_keep is None or jax.process_index() != 0:
        return []
    versions = export_versions(export_path)
    deleted = []
    for version in versions[: max(0, len(versions) - exports_to_keep)]:
        path = storage.join(export_path, str(version))
        storage.rmtree(path)
        deleted.append(path)
    return deleted


class LatestExporter(_SavedModelExporter):
    """Exports after every evaluation, keeping the newest ``exports_to_keep`` (TF's).

    Args:
      name: the export directory's name, ``model_dir/export/<name>``.
      serving_input_receiver_fn: as ``est.export_saved_model`` takes it.
      assets_extra: ``{destination: source file}`` copied into ``<export>/assets.extra/``.
      as_text: TF's text SavedModel; accepted with a warning.
      exports_to_keep: how many exports to keep (None: all).

    Example:
      >>> estimator.LatestExporter("latest", serving_input_fn, exports_to_keep=3)
    """

    def __init__(
        self,
        name: str,
        serving_input_receiver_fn: Callable,
        assets_extra: Mapping[str, str] | None = None,
        as_text: bool = False,
        exports_to_keep: int | None = 5,
    ):
        super().__init__(name, serving_input_receiver_fn, assets_extra, as_text)
        self._exports_to_keep = _check_keep(exports_to_keep)

    def export(self, estimator, export_path, checkpoint_path, eval_result, is_the_final_export):
        path = self._export(estimator, export_path, checkpoint_path)
        garbage_collect_exports(export_path, self._exports_to_keep)
        return path


class FinalExporter(_SavedModelExporter):
    """Exports once, after the final evaluation (TF's).

    Example:
      >>> estimator.FinalExporter("final", serving_input_fn)
    """

    def export(self, estimator, export_path, checkpoint_path, eval_result, is_the_final_export):
        if not is_the_final_export:
            return None
        return self._export(estimator, export_path, checkpoint_path)


def _loss_smaller(best_eval_result: dict, current_eval_result: dict) -> bool:
    """TF's default compare_fn: the current evaluation is better when its loss is lower."""
    for what, result in (
        ("best_eval_result", best_eval_result),
        ("current_eval_result", current_eval_result),
    ):
        if not result or "loss" not in result:
            raise EstimatorValueError(f"{what} cannot be empty or no loss is found in it.")
    return best_eval_result["loss"] > current_eval_result["loss"]


def _check_compare_fn(compare_fn: Any) -> Callable:
    if compare_fn is None or not callable(compare_fn):
        raise EstimatorTypeError(f"compare_fn must be callable, got {compare_fn!r}")
    try:
        args = set(inspect.signature(compare_fn).parameters)
    except (TypeError, ValueError):
        return compare_fn
    for name in ("best_eval_result", "current_eval_result"):
        if name not in args:
            raise EstimatorValueError(f"compare_fn ({compare_fn!r}) must include {name} argument.")
    return compare_fn


class BestExporter(_SavedModelExporter):
    """Exports the evaluations that beat the best so far (TF's ``BestExporter``).

    Args:
      name: the export directory's name, ``model_dir/export/<name>``.
      serving_input_receiver_fn: as ``est.export_saved_model`` takes it (required here).
      event_file_pattern: event files, relative to ``model_dir``, whose evaluations seed the
        best so far (TF's default ``eval/*.tfevents.*``; match ``EvalSpec.name``:
        ``eval_<name>/*.tfevents.*``); None starts from nothing.
      compare_fn: ``compare_fn(best_eval_result, current_eval_result) -> bool``, True when
        the current one is better; default a lower ``loss``.
      assets_extra, as_text: as ``LatestExporter``.
      exports_to_keep: how many of the best exports to keep (None: all).

    Example:
      >>> estimator.BestExporter(name="best", serving_input_receiver_fn=serving_input_fn,
      ...                        exports_to_keep=1)
    """

    def __init__(
        self,
        name: str = "best_exporter",
        serving_input_receiver_fn: Callable | None = None,
        event_file_pattern: str | None = "eval/*.tfevents.*",
        compare_fn: Callable = _loss_smaller,
        assets_extra: Mapping[str, str] | None = None,
        as_text: bool = False,
        exports_to_keep: int | None = 5,
    ):
        super().__init__(name, serving_input_receiver_fn, assets_extra, as_text)
        self._compare_fn = _check_compare_fn(compare_fn)
        self._exports_to_keep = _check_keep(exports_to_keep)
        if event_file_pattern is not None and not isinstance(event_file_pattern, str):
            raise EstimatorTypeError(
                f"event_file_pattern must be a str or None, got {event_file_pattern!r}"
            )
        self._event_file_pattern = event_file_pattern
        self._model_dir: str | None = None
        self._best_eval_result: dict | None = None

    def _better(self, best: dict | None, current: dict) -> bool:
        return best is None or bool(
            self._compare_fn(best_eval_result=best, current_eval_result=current)
        )

    def _best_from_event_files(self, model_dir: str, before_step: int | None) -> dict | None:
        """The best evaluation recorded in the event files, at steps before ``before_step``
        (the current evaluation is already written there and is judged on its own)."""
        by_step: dict[int, dict] = {}
        for path in storage.glob(model_dir, self._event_file_pattern):
            for event in event_reader.summary_iterator(path):
                if not event.HasField("summary"):
                    continue
                for value in event.summary.value:
                    scalar = event_reader.scalar_value(value)
                    if scalar is not None:
                        by_step.setdefault(int(event.step), {})[value.tag] = scalar
        best = None
        for step, result in sorted(by_step.items()):
            if before_step is not None and step >= before_step:
                continue
            result = {**result, "global_step": step}
            if self._better(best, result):
                best = result
        return best

    def export(self, estimator, export_path, checkpoint_path, eval_result, is_the_final_export):
        if self._model_dir != estimator.model_dir and self._event_file_pattern:
            self._model_dir = estimator.model_dir
            step = eval_result.get("global_step") if eval_result else None
            self._best_eval_result = self._best_from_event_files(self._model_dir, step)
            if self._best_eval_result is not None:
                log.info(
                    "BestExporter %r: best evaluation so far from the event files: %s",
                    self.name,
                    self._best_eval_result,
                )
        if not self._better(self._best_eval_result, eval_result):
            return None
        self._best_eval_result = dict(eval_result)
        path = self._export(estimator, export_path, checkpoint_path)
        garbage_collect_exports(export_path, self._exports_to_keep)
        return path


def as_exporters(exporters: Any) -> tuple[Exporter, ...]:
    """``EvalSpec.exporters`` as a tuple (one exporter or a list), each an ``Exporter``
    with its own name (TF's checks)."""
    if exporters is None:
        return ()
    if isinstance(exporters, Exporter):
        exporters = (exporters,)
    try:
        exporters = tuple(exporters)
    except TypeError:
        raise EstimatorTypeError(
            f"EvalSpec.exporters must be an Exporter or a list of them, got {exporters!r}"
        ) from None
    names = set()
    for e in exporters:
        if not isinstance(e, Exporter):
            raise EstimatorTypeError(
                f"EvalSpec.exporters must be estimator.Exporter instances (BestExporter, "
                f"LatestExporter, FinalExporter), got {type(e).__name__}"
            )
        if e.name in names:
            raise EstimatorValueError(
                f"EvalSpec.exporters must have unique names; {e.name!r} repeats"
            )
        names.add(e.name)
    return exporters


class ExportsInterrupted(EstimatorRuntimeError):
    """A stop request (SIGTERM) ended ``run_exporters`` before the named exporter ran."""


def run_exporters(
    estimator: Any,
    exporters: tuple[Exporter, ...],
    eval_result: dict,
    *,
    is_the_final_export: bool,
    checkpoint_path: str | None,
    should_stop: Callable[[], bool] | None = None,
) -> list[str | None]:
    """Runs every exporter after one evaluation (TF's ``_export_eval_result``): each
    exports into ``model_dir/export/<name>``; returns their results, None where one did not
    export. An exporter's error propagates; ``should_stop`` (asked before each exporter)
    ends the run with ``ExportsInterrupted``."""
    base = storage.join(estimator.model_dir, "export")
    results = []
    for e in exporters:
        if should_stop is not None and should_stop():
            raise ExportsInterrupted(e.name)
        results.append(
            e.export(
                estimator=estimator,
                export_path=storage.join(base, e.name),
                checkpoint_path=checkpoint_path,
                eval_result=eval_result,
                is_the_final_export=is_the_final_export,
            )
        )
    return results


__all__ = [
    "BestExporter",
    "Exporter",
    "FinalExporter",
    "LatestExporter",
    "as_exporters",
    "garbage_collect_exports",
    "run_exporters",
]
