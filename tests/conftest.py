"""Test setup: eight simulated CPU devices, set before JAX is imported anywhere."""

import functools
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ESTIMATOR_NO_PROGRESS_BAR", "1")
# Tests check behaviour, not speed: skipping XLA's optimisation passes compiles faster (an
# environment variable, so subprocesses started by tests get it too).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# The persistent compilation cache (on by default, in ~/.cache) stays off in tests: a warm cache
# would make them depend on earlier runs and hide compilations that tests count. Tests of the
# cache pass their own directory (or unset this in a subprocess's environment).
os.environ["TPU_ESTIMATOR_COMPILATION_CACHE_DIR"] = "off"

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")


# ---------------------------------------------------------------- the "slow" lane
# Tests that start processes, send signals or wait on wall-clock time are marked ``slow``
# from their source (the test, the fixtures it uses and the module's helpers it calls), so a
# new one is marked without anyone remembering to. CI runs everything;
# `pytest -m "not slow"` is the fast lane.
_SLOW_SIGNS = (
    "subprocess",
    "Popen",
    "sys.executable",
    "os.kill",
    "send_signal",
    "time.sleep",
    "_train_job",
    "_multihost_job",
    "_signal_job",
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: starts processes, sends signals or waits on wall-clock time (CI runs them)",
    )


@functools.cache  # a fixture's or parametrized test's source is read once, not per item
def _source(fn) -> str:
    import inspect

    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _slow_helpers(module) -> set[str]:
    """Names of the module's own functions whose source shows a slow sign."""
    import inspect

    return {
        name
        for name, fn in inspect.getmembers(module, inspect.isfunction)
        if fn.__module__ == module.__name__ and any(s in _source(fn) for s in _SLOW_SIGNS)
    }


def pytest_collection_modifyitems(config, items):
    import pytest

    helpers: dict = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module not in helpers:
            helpers[module] = _slow_helpers(module)
        sources = [_source(getattr(item, "function", None))]
        info = getattr(item, "_fixtureinfo", None)
        for defs in info.name2fixturedefs.values() if info else ():
            sources += [_source(d.func) for d in defs]
        signs = _SLOW_SIGNS + tuple(f"{n}(" for n in helpers.get(module, ()))
        if any(sign in src for src in sources for sign in signs):
            item.add_marker(pytest.mark.slow)
