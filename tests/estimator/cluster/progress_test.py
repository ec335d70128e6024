"""What a process publishes about its progress, and the stall rule the judges apply to it
(the two-process ends of it: tests/estimator/cluster/stall_test.py)."""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref

import pytest

from estimator.cluster import progress
from estimator.cluster.progress import Record, Seen


@pytest.fixture
def active(monkeypatch):
    """Phases recorded (as once the watchdog runs), from a fresh position."""
    start = progress._Position("startup", 0, 0, threading.get_ident())
    monkeypatch.setattr(progress, "_position", start)
    monkeypatch.setattr(progress, "_active", True)


def test_nothing_is_recorded_before_the_watchdog_runs(monkeypatch):
    monkeypatch.setattr(progress, "_active", False)
    before = progress._position
    progress.enter("input", 7)
    items = [1, 2]
    assert progress.each(items, "input") is items and progress._position is before


def test_enter_counts_phases_and_keeps_the_step_when_none_is_given(active):
    progress.enter("input", 6)
    progress.enter("step")
    record = progress.snapshot()
    assert (record.phase, record.step, record.progress) == ("step", 6, 2)


def test_each_marks_every_read_and_what_follows_it(active):
    seen = []
    step = iter(range(10, 20))
    for item in progress.each(["a", "b"], "input", then="step", step=lambda: next(step)):
        seen.append((item, progress._position.phase, progress._position.step))
    # Each read: "input" entered, then "step"; the final, empty read too.
    assert seen == [("a", "step", 10), ("b", "step", 11)]
    assert (progress._position.phase, progress._position.step) == ("step", 12)
    assert progress._position.progress == 6


def test_each_holds_no_reference_to_an_item_once_its_caller_let_go(active):
    class Chunk:  # stands for a chunk holding device input
        pass

    refs = []

    class Source:  # keeps nothing of what it hands out
        def __iter__(self):
            return self

        def __next__(self):
            chunk = Chunk()
            refs.append(weakref.ref(chunk))
            return chunk

    it = iter(progress.each(Source(), "input", then="step"))
    first = next(it)
    del first
    gc.collect()
    assert refs[0]() is None  # the wrapper, suspended, does not keep it alive


@pytest.mark.parametrize(
    "text, want",
    [
        (Record("input", 12, 31, False, "a.py:3 in f").to_json(5), ("input", 12, 31, False)),
        ("exited", None),
        ("17", None),  # a bare counter: a process that publishes no progress
        ('{"n": 1, "phase": "step"}', None),
    ],
)
def test_records_travel_as_json_with_the_beat_counter(text, want):
    record = Record.from_json(text)
    assert (record if record is None else tuple(record[:4])) == want


def _function_in(path: str, name: str, body: str):
    """A function whose frames carry ``path`` as their file (as if it lived there)."""
    namespace: dict = {}
    exec(compile(f"def {name}(lock, then):\n{body}", path, "exec"), namespace)
    return namespace[name]


def _blocked_in_user_code(lock, then):
    then(lock, None) if then else lock.acquire()  # this line is "where" the thread is


# The functions that end in ``lock.acquire()`` (a wait in C, as a blocked collective's).
_BLOCKING = ("collective_wait", "array_value", "_blocked_in_user_code")


def _stack_of(target, then) -> tuple[str, bool, str]:
    """``read_stack`` of a thread blocked in ``target(lock, then)``."""
    lock = threading.Lock()
    lock.acquire()
    thread = threading.Thread(target=target, args=(lock, then), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    try:
        while True:
            frame = sys._current_frames().get(thread.ident)
            if frame is not None and frame.f_code.co_name in _BLOCKING:
                return progress.read_stack(frame, "input")
            del frame
            assert time.monotonic() < deadline, "the thread never reached its wait"
            time.sleep(0.01)
    finally:
        lock.release()
        thread.join(5)


SITE = "/venv/lib/python3.11/site-packages"


def test_the_stack_says_whether_the_main_thread_waits_for_other_processes():
    utils = f"{SITE}/jax/experimental/multihost_utils.py"
    collective = _function_in(utils, "collective_wait", "    lock.acquire()")
    # process_allgather waiting on its result: in JAX's internals, called from multihost_utils.
    internal = _function_in(f"{SITE}/jax/_src/array.py", "array_value", "    lock.acquire()")
    gather = _function_in(utils, "process_allgather", "    then(lock, None)")
    assert _stack_of(collective, None)[1] is True
    assert _stack_of(gather, internal)[1] is True
    phase, waiting, where = _stack_of(_blocked_in_user_code, None)
    assert (phase, waiting) == ("input", False)
    assert (
        where.startswith("estimator/cluster/progress_test.py:") and "_blocked_in_user_code" in where
    )


def test_a_thread_tracing_or_compiling_is_in_phase_compile():
    compiler = _function_in(f"{SITE}/jax/_src/compiler.py", "compile", "    then(lock, None)")
    phase, waiting, where = _stack_of(compiler, _blocked_in_user_code)
    assert (phase, waiting) == ("compile", False) and "_blocked_in_user_code" in where


def _seen(progress_count: int, waiting: bool, *, moved=0.0, beat=99.0, phase="input") -> Seen:
    return Seen(Record(phase, 6, progress_count, waiting), moved, beat)


# now=100, bound=60, fresh=5: everyone has been still for 100 s unless ``moved`` says not.
STALL_CASES = [
    # (case, participants, stuck)
    ("the one not waiting", {0: _seen(9, True), 1: _seen(9, False)}, 1),
    ("it moved lately", {0: _seen(9, True), 1: _seen(9, False, moved=50.0)}, None),
    ("a waiting one moved", {0: _seen(9, True, moved=50.0), 1: _seen(9, False)}, None),
    ("nobody waits: busy on their own", {0: _seen(9, False), 1: _seen(9, False)}, None),
    ("all wait: the one behind", {0: _seen(12, True), 1: _seen(11, True), 2: _seen(12, True)}, 1),
    (
        "of the free ones, the one behind",
        {0: _seen(9, True), 1: _seen(8, False), 2: _seen(7, False)},
        2,
    ),
    (
        "of equal free ones, the lowest id",
        {0: _seen(9, True), 2: _seen(9, False), 1: _seen(9, False)},
        1,
    ),
    (
        "a late heartbeat: the liveness judge's",
        {0: _seen(9, True), 1: _seen(9, False, beat=90.0)},
        None,
    ),
    ("one participant", {1: _seen(9, False)}, None),
    (
        "compiling: at least 30 minutes",
        {0: _seen(9, True), 1: _seen(9, False, phase="compile")},
        None,
    ),
]


@pytest.mark.parametrize("case, seen, stuck", STALL_CASES, ids=[c[0] for c in STALL_CASES])
def test_the_stall_rule(case, seen, stuck):
    assert progress.stuck_process(seen, now=100.0, bound=60.0, fresh=5.0) == stuck


def test_a_compile_is_cut_at_the_bound_only_when_the_bound_is_longer_than_the_floor():
    seen = {0: _seen(9, True), 1: _seen(9, False, phase="compile")}
    later = progress.COMPILE_FLOOR + 1.0
    assert progress.stuck_process(seen, now=later, bound=60.0, fresh=later) == 1
    bound = progress.COMPILE_FLOOR * 2
    assert progress.stuck_process(seen, now=later, bound=bound, fresh=later) is None
