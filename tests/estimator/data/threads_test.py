"""Pooled background threads (``data/threads.py``): a finished thread takes the next task, a
busy one never delays a new task, a task's error leaves its thread alive.

Waits are on events with generous deadlines, never on elapsed time.
"""

from __future__ import annotations

import doctest
import logging
import threading

from estimator.data import threads

DEADLINE = 60.0  # seconds; only reached if something is broken


def _run(fn, name="task") -> threading.Event:
    done = threads.run_in_thread(fn, name=name)
    assert done.wait(DEADLINE)
    return done


def test_a_task_runs_on_a_daemon_thread_named_after_it():
    seen = {}

    def task():
        me = threading.current_thread()
        seen.update(name=me.name, daemon=me.daemon, main=me is threading.main_thread())

    _run(task, name="input-eval")
    assert seen == {"name": "input-eval", "daemon": True, "main": False}


def test_a_finished_thread_takes_the_next_task():
    idents = []
    _run(lambda: idents.append(threading.get_ident()), name="first")
    existing = {t.ident for t in threading.enumerate()}  # one pooled thread idle at least
    for i in range(3):
        _run(lambda: idents.append(threading.get_ident()), name=f"then-{i}")
    assert set(idents[1:]) <= existing  # no thread started for them


def test_a_busy_thread_does_not_delay_a_new_task():
    release, started, second = threading.Event(), threading.Event(), threading.Event()
    idents = []

    def blocking():
        idents.append(threading.get_ident())
        started.set()
        release.wait(DEADLINE)

    first = threads.run_in_thread(blocking, name="blocking")
    assert started.wait(DEADLINE)
    done = threads.run_in_thread(
        lambda: (idents.append(threading.get_ident()), second.set()), name="second"
    )
    assert second.wait(DEADLINE)  # ran while the first task still blocks
    assert not first.is_set()
    release.set()
    assert first.wait(DEADLINE) and done.wait(DEADLINE)
    assert idents[0] != idents[1]


def test_an_error_is_logged_and_the_thread_lives_on(caplog):
    idents = []

    def failing():
        idents.append(threading.get_ident())
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="estimator"):
        _run(failing, name="failing-task")
    alive = {t.ident: t for t in threading.enumerate()}
    assert idents[0] in alive and alive[idents[0]].name == "estimator-worker"  # idle again
    records = [r for r in caplog.records if "failing-task" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info[0] is RuntimeError


def test_the_event_is_set_even_when_the_task_fails():
    assert _run(lambda: 1 / 0).is_set()


def test_docstring_examples():
    assert doctest.testmod(threads).failed == 0
