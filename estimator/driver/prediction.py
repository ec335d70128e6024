"""predict(): yields each real example once, in input order."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from ..core.errors import EstimatorTypeError, EstimatorValueError
from ..core.spec import ModeKeys
from ..parallel import multihost
from .evaluation import DeviceLoops
from .job import Job


def checked_predict_keys(predict_keys) -> list[str] | None:
    """``predict``'s ``predict_keys`` as a list of names (one str is one name).

    Raises:
      EstimatorTypeError: neither a str nor a list or tuple of str.
    """
    if isinstance(predict_keys, str):
        return [predict_keys]
    if predict_keys is not None and (
        not isinstance(predict_keys, (list, tuple))
        or not all(isinstance(k, str) for k in predict_keys)
    ):
        raise EstimatorTypeError(
            f"predict_keys must be a str or a list of str, got {predict_keys!r}"
        )
    return predict_keys


def _select(predictions, keys: Sequence[str] | None):
    if keys is None:
        return predictions
    if not isinstance(predictions, Mapping):
        raise EstimatorValueError("predict_keys can only be used when predictions is a dict")
    missing = [k for k in keys if k not in predictions]
    if missing:
        raise EstimatorValueError(
            f"predict_keys {missing} not found in predictions; available: {sorted(predictions)}"
        )
    return {k: predictions[k] for k in keys}


def run_predict_loops(
    job: Job,
    input_fn,
    *,
    predict_keys,
    hooks,
    checkpoint_path,
    yield_single_examples: bool,
    gather: bool = False,
) -> Iterator:
    """Yields the predictions of this process's examples; with ``gather`` (many processes)
    process 0 yields every process's examples in global order and the others none."""
    if gather:
        to_host = multihost.to_host
    else:

        def to_host(outs):
            return multihost.local_to_host(outs, job.mesh)

    layout = job.feeder.layout(ModeKeys.PREDICT)
    for chunk, preds, _ in DeviceLoops(
        job,
        input_fn,
        ModeKeys.PREDICT,
        steps=None,
        hooks=hooks,
        checkpoint_path=checkpoint_path,
        to_host=to_host,
    ):
        if gather and not multihost.is_process_0():
            continue  # the loops still run here: every process takes part in each of them
        preds = _select(preds, predict_keys)
        mask = layout.count_once(chunk.host_mask)
        if not gather:
            mask = multihost.local_rows(mask, job.mesh)
        for i in range(chunk.steps):
            keep = mask[i]
            if isinstance(preds, Mapping):
                batch = {k: np.asarray(v[i])[keep] for k, v in preds.items()}
                if yield_single_examples:
                    n = int(keep.sum())
                    for j in range(n):
                        yield {k: v[j] for k, v in batch.items()}
                else:
                    yield batch
            else:
                batch = np.asarray(preds[i])[keep]
                if yield_single_examples:
                    yield from batch
                else:
                    yield batch
