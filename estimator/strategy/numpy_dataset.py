"""``TPUStrategy.experimental_make_numpy_dataset``: numpy arrays as a dataset of examples.

TF returned ``tf.data.Dataset.from_tensor_slices(numpy_input)`` placed on the host; programs
then ``.batch(global_batch)`` it and hand it to ``experimental_distribute_dataset``. This is
the same over numpy: an iterable of examples (slices along axis 0 of every array) with
``batch``, ``repeat`` and ``take``.

Example:
  >>> ds = strategy.experimental_make_numpy_dataset((x, y)).batch(64, drop_remainder=True)
  >>> for features, labels in strategy.experimental_distribute_dataset(ds):
  ...     strategy.run(step_fn, args=(features, labels))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from ..core.errors import EstimatorValueError


class NumpyDataset:
    """A re-iterable dataset over numpy data (``make`` builds each iteration afresh)."""

    def __init__(self, make: Callable[[], Iterator[Any]]):
        self._make = make

    @classmethod
    def from_tensor_slices(cls, data: Any) -> NumpyDataset:
        """Examples ``data[i]`` of every leaf; all leaves need the same first dimension.

        Raises:
          ValueError: a scalar leaf, or leaves with different first dimensions.
        """
        leaves, treedef = jax.tree.flatten(data)
        arrays = [np.asarray(x) for x in leaves]
        if not arrays or any(a.ndim == 0 for a in arrays):
            raise EstimatorValueError(
                "experimental_make_numpy_dataset needs arrays with a first dimension"
            )
        sizes = {a.shape[0] for a in arrays}
        if len(sizes) != 1:
            raise EstimatorValueError(
                f"experimental_make_numpy_dataset: arrays have different first dimensions {sizes}"
            )
        n = sizes.pop()

        def make():
            for i in range(n):
                yield jax.tree.unflatten(treedef, [a[i] for a in arrays])

        return cls(make)

    def __iter__(self) -> Iterator[Any]:
        return self._make()

    def batch(self, batch_size: int, drop_remainder: bool = False) -> NumpyDataset:
        """Stacks consecutive examples into batches of ``batch_size`` (the last may be short
        unless ``drop_remainder``)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise EstimatorValueError(f"batch_size must be a positive int, got {batch_size!r}")

        def make():
            rows = []
            for example in self:
                rows.append(example)
                if len(rows) == batch_size:
                    yield _stack(rows)
                    rows = []
            if rows and not drop_remainder:
                yield _stack(rows)

        return NumpyDataset(make)

    def repeat(self, count: int | None = None) -> NumpyDataset:
        """The dataset ``count`` times over (forever when None)."""

        def make():
            done = 0
            while count is None or done < count:
                yield from self
                done += 1

        return NumpyDataset(make)

    def take(self, count: int) -> NumpyDataset:
        """The first ``count`` elements."""

        def make():
            for i, element in enumerate(self):
                if i >= count:
                    return
                yield element

        return NumpyDataset(make)


def _stack(rows: list) -> Any:
    return jax.tree.map(lambda *xs: np.stack(xs), *rows)


__all__ = ["NumpyDataset"]
