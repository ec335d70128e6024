"""predict(): yields each real example once, in input order."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from ..parallel import multihost
from ..spec import ModeKeys
from .evaluation import _dedupe_broadcast, _loops


def _select(predictions, keys: Sequence[str] | None):
    if keys is None:
        return predictions
    if not isinstance(predictions, Mapping):
        raise ValueError("predict_keys can only be used when predictions is a dict")
    missing = [k for k in keys if k not in predictions]
    if missing:
        raise ValueError(
            f"predict_keys {missing} not found in predictions; available: {sorted(predictions)}"
        )
    return {k: predictions[k] for k in keys}


def run_predict_loops(
    est,
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
        fetch = multihost.to_host
    else:

        def fetch(outs):
            return multihost.local_to_host(outs, est.mesh)

    for chunk, preds, _ in _loops(
        est,
        input_fn,
        ModeKeys.PREDICT,
        steps=None,
        hooks=hooks,
        checkpoint_path=checkpoint_path,
        fetch=fetch,
    ):
        if gather and not multihost.is_process_0():
            continue  # the loops still run here: every process takes part in each of them
        preds = _select(preds, predict_keys)
        mask = _dedupe_broadcast(est, chunk.host_mask)
        if not gather:
            mask = multihost.local_rows(mask, est.mesh)
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
