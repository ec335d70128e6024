"""The `Metric` interface: immutable, mergeable metric state computed on the host.

A metric is a small frozen dataclass of sufficient statistics for one batch (sums, counts,
a confusion matrix). Batches combine with `merge`, and `compute` turns the merged state into
the final value, so evaluating batch by batch gives the same result as evaluating the whole
data set at once::

    m = metrics.accuracy(labels_0, predictions_0)
    m = m.merge(metrics.accuracy(labels_1, predictions_1))
    m.compute()  # accuracy over both batches

Every metric class offers the same four entry points (the CLU pattern):

* ``from_model_output(...)``: classmethod, the state for one batch (the `metrics.<name>`
  factories call it);
* ``empty(...)``: classmethod, the identity for `merge` (zero statistics);
* ``merge(other)``: a new metric combining both; `other` must be of exactly the same type and
  built with the same options, otherwise a `TypeError` or `ValueError` says what differs;
* ``compute()``: the value, a python float for scalar metrics.

Writing your own metric
-----------------------
Subclass `Metric` as a frozen dataclass, implement `from_model_output` and `compute`. Fields
are state and are *added* elementwise by the default `merge`; mark configuration fields with
`static_field()` so they are compared (never added) on merge. Override `_merge` when the
statistics do not combine by addition (a maximum, say).

Example:

>>> import dataclasses
>>> import numpy as np
>>> import metrics
>>> @dataclasses.dataclass(frozen=True)
... class PositiveRate(metrics.Metric):
...     positives: float
...     count: float
...     threshold: float = metrics.static_field(default=0.5)
...
...     @classmethod
...     def from_model_output(cls, predictions, *, threshold=0.5):
...         predictions = np.asarray(predictions)
...         return cls(float(np.sum(predictions > threshold)), float(predictions.size), threshold)
...
...     def compute(self):
...         return self.positives / self.count if self.count else 0.0
>>> m = PositiveRate.from_model_output([0.9, 0.2]).merge(PositiveRate.from_model_output([0.7]))
>>> m.compute()
0.6666666666666666
>>> @dataclasses.dataclass(frozen=True)
... class MaxAbsError(metrics.Metric):
...     value: float
...
...     @classmethod
...     def from_model_output(cls, labels, predictions):
...         error = np.abs(np.asarray(labels) - np.asarray(predictions))
...         return cls(float(np.max(error, initial=0.0)))
...
...     def _merge(self, other):
...         return MaxAbsError(max(self.value, other.value))
...
...     def compute(self):
...         return self.value
>>> m = MaxAbsError.from_model_output([1.0], [3.0])
>>> m.merge(MaxAbsError.from_model_output([0], [1])).compute()
2.0

For a statistic that cannot be computed from per-batch sums (an exact ROC AUC, a median),
`metrics.collecting` keeps every row on the host and calls a function once at the end.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, TypeVar

import numpy as np

__all__ = ["Metric", "static_field"]

_M = TypeVar("_M", bound="Metric")

_STATIC = "metrics_static"


def static_field(**kwargs: Any) -> Any:
    """A dataclass field holding configuration rather than state.

    Static fields are compared when two metrics merge (a mismatch is a `ValueError`) and are
    carried over unchanged; every other field is state and is added by the default `merge`.

    Args:
      **kwargs: passed to `dataclasses.field` (e.g. `default=0.5`).

    Returns:
      A `dataclasses.field` marked as static.

    Example:

    >>> import dataclasses, metrics
    >>> @dataclasses.dataclass(frozen=True)
    ... class Hits(metrics.Metric):
    ...     hits: float
    ...     k: int = metrics.static_field(default=1)
    ...     @classmethod
    ...     def from_model_output(cls, hits, *, k=1):
    ...         return cls(float(sum(hits)), k)
    ...     def compute(self):
    ...         return self.hits
    >>> Hits.from_model_output([1, 1], k=5).merge(Hits.from_model_output([1], k=5)).compute()
    3.0
    """
    metadata = dict(kwargs.pop("metadata", None) or {})
    metadata[_STATIC] = True
    return dataclasses.field(metadata=metadata, **kwargs)


class Metric(abc.ABC):
    """Abstract base of mergeable metrics; see the module docstring for the pattern.

    Subclasses implement `from_model_output` and `compute`; dataclass subclasses whose state
    adds up get `merge` for free, others override `_merge`. `merge` itself is a template
    method: it checks that `other` has the same type and options, then calls `_merge`.
    """

    @classmethod
    @abc.abstractmethod
    def from_model_output(cls, *args: Any, **kwargs: Any) -> Metric:
        """Returns the metric state for one batch of model outputs."""

    @classmethod
    def empty(cls, *args: Any, **kwargs: Any) -> Metric:
        """Returns the state of no examples: the identity of `merge`.

        Built-in metrics take the same options as their factory (e.g.
        `MeanIoU.empty(num_classes)`); subclasses that need an identity override this.

        Raises:
          NotImplementedError: if the subclass does not define it.
        """
        raise NotImplementedError(f"{cls.__name__} does not define empty().")

    @abc.abstractmethod
    def compute(self) -> float | np.ndarray:
        """Returns the metric value (a python float for scalar metrics)."""

    def merge(self: _M, other: Metric) -> _M:
        """Returns a new metric combining the statistics of `self` and `other`.

        Args:
          other: a metric of exactly the same type, built with the same options.

        Returns:
          A new metric; neither input is modified.

        Raises:
          TypeError: if `other` is not a metric of the same type.
          ValueError: if `other` was built with different options (e.g. `num_classes`).
        """
        if not isinstance(other, Metric):
            raise TypeError(
                f"`other` must be a metrics.Metric to merge into {type(self).__name__}, "
                f"got {type(other).__name__}."
            )
        if type(other) is not type(self):
            raise TypeError(
                f"Cannot merge {type(self).__name__} with {type(other).__name__}: `other` "
                "must be the same metric type (did two metric_fn calls return different "
                "metrics under the same name?)."
            )
        mine, theirs = self.config(), other.config()
        for name, value in mine.items():
            if not _same(value, theirs[name]):
                raise ValueError(
                    f"Cannot merge {type(self).__name__} metrics built with different "
                    f"`{name}`: {value!r} vs {theirs[name]!r}."
                )
        return self._merge(other)

    def _merge(self: _M, other: _M) -> _M:
        """Adds every state field; override for statistics that do not add up."""
        if not dataclasses.is_dataclass(self):
            raise NotImplementedError(
                f"{type(self).__name__} is not a dataclass, so it must override _merge()."
            )
        summed = {
            name: getattr(self, name) + getattr(other, name)
            for name in _field_names(type(self), static=False)
        }
        return dataclasses.replace(self, **summed)

    def config(self) -> dict[str, Any]:
        """Returns the static (configuration) fields, by name."""
        if not dataclasses.is_dataclass(self):
            return {}
        return {name: getattr(self, name) for name in _field_names(type(self), static=True)}


@functools.cache
def _field_names(cls: type, *, static: bool) -> tuple[str, ...]:
    """A dataclass metric's configuration (``static``) or state field names; cached per type
    because metric_fn's results are merged once per eval batch."""
    return tuple(
        f.name for f in dataclasses.fields(cls) if f.metadata.get(_STATIC, False) == static
    )


def _same(a: Any, b: Any) -> bool:
    """Configuration equality: arrays by value, functions by code (lambdas remade per batch)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and bool(np.array_equal(a, b))
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if code_a is not None and code_b is not None:
        return a is b or code_a == code_b
    return bool(a == b)
