"""An input_fn that returns one batch, ``(features, labels)`` or ``(features, None)``, as TF's did.

A TF input_fn could return tensors instead of a ``Dataset``: ``return features, labels`` (DCGAN's
noise input returns ``{"random_noise": noise}, None``). Here input_fn returns an iterable of
batches, so such a pair would be iterated as two "batches". ``as_batches`` recognises the pair
first; the rule (the only reading a 2-tuple of arrays can have in TF) is:

- a ``tuple`` (not a list, not a namedtuple) of two entries, whose first entry (features) is an
  array or a dict of arrays, and whose second (labels) is None, an array or a dict of arrays,
  is ONE batch;
- every array of it must lead with the same (batch) dimension; when they do not, the pair is
  ambiguous (two batches in a tuple, or a transposed entry) and the error says both readings;
- a list, a generator, a tuple of batches whose first entry is itself a tuple
  (``((f1, l1), (f2, l2))``) are iterables of batches, as before.

What the one batch becomes follows what TF did with tensors that are not a ``Dataset``: TRAIN
evaluated them every step, so the batch repeats for as many steps as asked (TF's constant
tensors gave the same batch every step; a random op drew anew, which numpy arrays drawn once in
input_fn do not: yield from a generator for a new batch each step). EVAL and PREDICT see it
once (DCGAN's predict input is one ``from_tensors`` element; TF would loop forever on constant
tensors), so ``evaluate`` and ``predict`` end after it.

Example:
  >>> def noise_input_fn(params):
  ...     np.random.seed(0)
  ...     noise = np.random.randn(params["batch_size"], 100).astype(np.float32)
  ...     return {"random_noise": noise}, None       # one batch
  >>> images = [p["generated_images"] for p in est.predict(noise_input_fn)]
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import jax

from ..core.errors import EstimatorValueError
from ..core.spec import ModeKeys

log = logging.getLogger("estimator")


def _is_array(x: Any) -> bool:
    """An array of any kind (numpy, JAX, an eager TF tensor)."""
    return not isinstance(x, (list, tuple, Mapping)) and hasattr(x, "shape") and hasattr(x, "dtype")


def _arrays(x: Any) -> list | None:
    """The arrays of an array or a dict of arrays (nested dicts too), else None."""
    if _is_array(x):
        return [x]
    if isinstance(x, Mapping) and x:
        leaves = jax.tree_util.tree_leaves(dict(x))
        if leaves and all(_is_array(v) for v in leaves):
            return leaves
    return None


def _pair(data: Any) -> tuple[list, list] | None:
    """``(feature arrays, label arrays)`` when ``data`` has the single-batch shape, else None.

    ``(features, None)`` is one batch whatever features holds (no iterable of batches holds
    None): the batch checks then name what is wrong in it (a Python list, a scalar).
    """
    if type(data) is not tuple or len(data) != 2:  # a namedtuple is one structured batch
        return None
    first, second = data
    if not (_is_array(first) or (isinstance(first, Mapping) and first)):
        return None
    if second is None:
        return _arrays(first) or [], []
    features, labels = _arrays(first), _arrays(second)
    return None if features is None or labels is None else (features, labels)


def _rows(features: list, labels: list) -> int | None:
    """The batch's rows (None: no entry has a batch dimension yet); an error when the entries
    do not agree, for then the pair is ambiguous."""
    f_rows = {int(x.shape[0]) for x in features if len(x.shape)}
    l_rows = {int(x.shape[0]) for x in labels if len(x.shape)}
    if len(f_rows | l_rows) <= 1:
        return next(iter(f_rows | l_rows), None)
    raise EstimatorValueError(
        "input_fn returned a 2-tuple that is ambiguous: as TF reads it, it is one "
        "(features, labels) batch, but its arrays lead with different sizes (features "
        f"{sorted(f_rows)}, labels {sorted(l_rows) or '-'}), and every entry of a batch leads "
        "with the batch dimension. If it is two batches, return them in a list or yield them "
        "from a generator; if it is one, make every entry batch-major"
    )


def as_batches(data: Any, *, mode: str, batch_size: int | None) -> Iterator | None:
    """An iterator over the one batch input_fn returned, or None when ``data`` is not one.

    Args:
      data: what input_fn returned.
      mode: the ``ModeKeys`` the input is for (TRAIN repeats the batch, see the module doc).
      batch_size: ``params["batch_size"]`` input_fn was given (None: not checked).

    Raises:
      ValueError: the pair's arrays do not agree on the batch dimension, or it holds more rows
        than the batch size (a whole data set returned as one pair).
    """
    pair = _pair(data)
    if pair is None:
        return None
    rows = _rows(*pair)
    if batch_size is not None and rows is not None and rows > batch_size:
        raise EstimatorValueError(
            f"input_fn returned one (features, labels) batch of {rows} rows, but "
            f"params['batch_size'] is {batch_size}: a tuple returned by input_fn is one batch "
            "(TF's rule). To feed a whole data set, yield batches of params['batch_size'] rows "
            "from a generator (or return a list of them)"
        )
    if mode == ModeKeys.TRAIN:
        log.info(
            "input_fn returned one (features, labels) batch: training repeats it every step, "
            "as TF repeated tensors that are not a Dataset (yield batches from a generator "
            "for new data each step)."
        )
        return itertools.repeat(data)
    return iter([data])


__all__ = ["as_batches"]
