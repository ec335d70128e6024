"""Input chunks agreed across processes (``data/synced.py``).

In one process ``synced`` hands the prefetcher back unchanged. The agreement itself is
tested in one process by standing in for a second one: ``multihost.gather`` returns this
process's row and the row the test gives the other process, as the real gather would.
References are numpy slices of the chunk's own arrays and the rows written in the test.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from estimator.core.errors import EstimatorValueError
from estimator.data import synced as synced_lib
from estimator.data.inputs import Chunk
from estimator.data.plan import MAX_LOOPS_PER_CALL
from estimator.engine import ahead
from estimator.parallel import multihost
from estimator.parallel.mesh import make_mesh

ROWS = 16  # global rows per step: 2 per replica


@pytest.fixture(scope="module")
def mesh():
    return make_mesh()


def _chunk(mesh, n: int, *, steps: int | None = None, loop_steps=0, loop_ends=()) -> Chunk:
    """``n`` steps of arrays (``steps`` of them real); values say their step and row."""
    x = np.arange(n * ROWS * 3, dtype=np.float32).reshape(n, ROWS, 3)
    y = np.arange(n * ROWS, dtype=np.int32).reshape(n, ROWS)
    steps = n if steps is None else steps
    host_mask = np.zeros((n, ROWS), bool)
    host_mask[:steps] = True
    features, labels, mask = multihost.global_batch(
        ({"x": x}, y, host_mask.astype(np.float32)), mesh
    )
    return Chunk(
        features,
        labels,
        mask,
        host_mask,
        steps=steps,
        pulls=steps,
        loop_steps=loop_steps,
        loop_ends=tuple(loop_ends),
    )


@pytest.fixture
def other_process(monkeypatch):
    """Sets what a second process contributes to each gather (a row, or a function of ours)."""
    rows = []

    def gather(values):
        other = rows[0](values) if callable(rows[0]) else np.asarray(rows[0], values.dtype)
        return np.stack([values, other])

    monkeypatch.setattr(multihost, "gather", gather)
    return rows


def _eval_row(steps: int, loop_steps: int = 0, loop_ends=()) -> np.ndarray:
    row = np.full(2 + MAX_LOOPS_PER_CALL, -1, np.int64)
    row[:2] = steps, loop_steps
    row[2 : 2 + len(loop_ends)] = loop_ends
    return row


def test_one_process_gets_the_prefetcher_itself(mesh):
    prefetch = iter([])
    assert synced_lib.synced(prefetch, pipe=None, pads=True, mesh=mesh) is prefetch
    assert synced_lib.synced(prefetch, pipe=None, pads=False, mesh=mesh) is prefetch


@pytest.mark.parametrize("ours, theirs, agreed", [(4, 4, 4), (4, 2, 2), (3, 5, 3)])
def test_training_runs_the_shortest_processes_steps(mesh, other_process, ours, theirs, agreed):
    other_process.append([theirs])
    chunk = _chunk(mesh, ours)
    got = next(synced_lib.SyncedChunks(iter([chunk]), None, pads=False, mesh=mesh))
    assert got.steps == agreed
    np.testing.assert_array_equal(
        np.asarray(got.features["x"]), np.asarray(chunk.features["x"])[:agreed]
    )
    np.testing.assert_array_equal(np.asarray(got.labels), np.asarray(chunk.labels)[:agreed])
    np.testing.assert_array_equal(got.host_mask, np.ones((agreed, ROWS), bool))
    assert got.features["x"].sharding == chunk.features["x"].sharding


@pytest.mark.parametrize("ours_ended", [False, True])
def test_training_ends_when_any_input_ends(mesh, other_process, ours_ended):
    other_process.append([3 if ours_ended else 0])
    stream = iter([] if ours_ended else [_chunk(mesh, 3), _chunk(mesh, 3)])
    chunks = synced_lib.SyncedChunks(stream, None, pads=False, mesh=mesh)
    assert list(chunks) == []
    assert next(chunks, None) is None  # and stays ended


def test_evaluation_runs_the_most_real_steps_of_any_process(mesh, other_process):
    """Ours has 2 real steps of a planned 8, theirs 6: 6 steps run, our last 4 all padding,
    with the loop ends of the process still reading, cut to the steps that run."""
    other_process.append(_eval_row(6, loop_steps=8, loop_ends=(4, 8)))
    chunk = _chunk(mesh, 8, steps=2, loop_steps=8, loop_ends=(2,))
    got = next(synced_lib.SyncedChunks(iter([chunk]), None, pads=True, mesh=mesh))
    assert (got.steps, got.loop_steps, got.loop_ends) == (6, 8, (4,))
    assert np.asarray(got.features["x"]).shape[0] == 6
    np.testing.assert_array_equal(
        np.asarray(got.features["x"]), np.asarray(chunk.features["x"])[:6]
    )
    want_mask = np.zeros((6, ROWS), bool)
    want_mask[:2] = True
    np.testing.assert_array_equal(got.host_mask, want_mask)


def test_evaluation_keeps_its_own_plan_when_it_has_the_most_steps(mesh, other_process):
    other_process.append(_eval_row(1, loop_steps=4, loop_ends=(1,)))
    chunk = _chunk(mesh, 4, loop_steps=4, loop_ends=(4,))
    got = next(synced_lib.SyncedChunks(iter([chunk]), None, pads=True, mesh=mesh))
    assert (got.steps, got.loop_steps, got.loop_ends) == (4, 4, (4,))
    assert got.ends_loop


class _Example(NamedTuple):
    features: dict
    labels: np.ndarray


class _Pipe:
    """What ``SyncedChunks`` reads of a pipeline whose input has ended."""

    def __init__(self):
        example = ({"x": np.zeros((1, 1, 3), np.float32)}, np.zeros((1, 1), np.int32))
        self.sig = ahead.chunk_signature(_Example(*example))  # per-row shapes and dtypes
        self.rows_per_step = ROWS

    def get_state(self):
        return {"offset": 96}


def test_a_process_whose_input_ended_contributes_padding_steps(mesh, other_process):
    other_process.append(_eval_row(3, loop_steps=4, loop_ends=(3,)))
    chunks = synced_lib.SyncedChunks(iter([]), _Pipe(), pads=True, mesh=mesh)
    got = next(chunks)
    assert (got.steps, got.loop_steps, got.loop_ends, got.pulls) == (3, 4, (3,), 0)
    assert got.input_state == {"offset": 96}
    np.testing.assert_array_equal(np.asarray(got.features["x"]), np.zeros((3, ROWS, 3), np.float32))
    np.testing.assert_array_equal(np.asarray(got.labels), np.zeros((3, ROWS), np.int32))
    np.testing.assert_array_equal(np.asarray(got.mask), np.zeros((3, ROWS), np.float32))
    assert not got.host_mask.any() and got.host_mask.shape == (3, ROWS)
    other_process[0] = _eval_row(0)
    assert next(chunks, None) is None  # every process ended: the evaluation ends


def test_a_process_without_any_batch_cannot_pad(mesh, other_process):
    other_process.append(_eval_row(2, loop_steps=2, loop_ends=(2,)))
    pipe = _Pipe()
    pipe.sig = None
    with pytest.raises(EstimatorValueError, match="produced no batches"):
        next(synced_lib.SyncedChunks(iter([]), pipe, pads=True, mesh=mesh))


def test_close_closes_the_prefetcher(mesh):
    class Prefetch:
        closed = False

        def close(self):
            self.closed = True

    prefetch = Prefetch()
    synced_lib.SyncedChunks(prefetch, None, pads=True, mesh=mesh).close()
    assert prefetch.closed
