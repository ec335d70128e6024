"""Test setup: eight simulated CPU devices, set before JAX is imported anywhere."""

import functools
import os

import pytest

# Besides the 8 devices: XLA:CPU's newer fusion emitters and XNNPACK kernels cost compile time
# that tests never win back (the zoo's programs compile in about 60% of the time without them;
# measured at df4c92f, 2026-12-03, 2-core CPU: the accelerator smoke run compiled in 39.3 s,
# not 66.8).
_TEST_XLA_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_use_xnnpack=false",
)
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_TEST_XLA_FLAGS]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# etils.epath picks TensorFlow's file system for gs:// once TensorFlow is imported (a test of
# the TF SavedModel does), and TF's GCS client ignores the GCS emulator: gcsfs, always.
os.environ["EPATH_USE_TF"] = "false"
os.environ.setdefault("TPU_ESTIMATOR_NO_PROGRESS_BAR", "1")
# Tests check behaviour, not speed: skipping XLA's optimisation passes compiles faster (an
# environment variable, so subprocesses started by tests get it too).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# The persistent compilation cache (on by default, in ~/.cache) never reads a user's cache in
# tests: a warm cache would make them depend on earlier runs. Each pytest run shares one cache
# of its own instead (``pytest_configure`` below: a fresh directory, removed at the end), so a
# program that many tests compile (the shared MLP's train loop, say) compiles once per run;
# ``TPU_ESTIMATOR_SUITE_CACHE=off`` runs without it. Tests that count compilations run with
# the cache off (``counts_compiles``); tests of the cache pass their own directory.

import jax  # noqa: E402

from estimator.core import compilation  # noqa: E402

jax.config.update("jax_platforms", "cpu")
_CACHE_ENV = compilation.ENV_VAR
os.environ[_CACHE_ENV] = "off"


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
# Tests that count XLA compilations (they run with the run's compilation cache off).
_COMPILE_SIGNS = ("backend_compile", "CompileCounter", "cache_hits", "jaxpr_to_mlir")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: starts processes, sends signals or waits on wall-clock time (CI runs them)",
    )
    config.addinivalue_line(
        "markers", "counts_compiles: counts XLA compilations, so runs without the run's cache"
    )
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # an xdist worker: the controller made the run's cache
        os.environ[_CACHE_ENV] = workerinput["suite_cache"]
    elif os.environ.get("TPU_ESTIMATOR_SUITE_CACHE", "").strip().lower() not in compilation._OFF:
        import tempfile

        config._suite_cache = tempfile.mkdtemp(prefix="tpu-estimator-suite-cache-")
        os.environ[_CACHE_ENV] = config._suite_cache


def pytest_unconfigure(config):
    path = getattr(config, "_suite_cache", None)
    if path:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist: every worker shares the controller's cache."""
    node.workerinput["suite_cache"] = os.environ[_CACHE_ENV]


@pytest.fixture(autouse=True)
def _compiles_counted_without_the_cache(request, monkeypatch):
    """A test that counts compilations sees its own, not programs earlier tests cached."""
    if request.node.get_closest_marker("counts_compiles") is None:
        yield
    else:
        monkeypatch.setenv(_CACHE_ENV, "off")
        compilation.configure_cache(False)
        yield


@functools.cache  # a fixture's or parametrized test's source is read once, not per item
def _source(fn) -> str:
    import inspect

    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _helpers(module, signs: tuple[str, ...]) -> set[str]:
    """Names of the module's own functions whose source shows one of ``signs``."""
    import inspect

    return {
        name
        for name, fn in inspect.getmembers(module, inspect.isfunction)
        if fn.__module__ == module.__name__ and any(s in _source(fn) for s in signs)
    }


# Marks read from a test's source (the test, its fixtures, the module's helpers it calls).
_MARK_SIGNS = {"slow": _SLOW_SIGNS, "counts_compiles": _COMPILE_SIGNS}


def pytest_collection_modifyitems(config, items):
    helpers: dict = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module not in helpers:
            helpers[module] = {m: _helpers(module, s) for m, s in _MARK_SIGNS.items()}
        sources = [_source(getattr(item, "function", None))]
        info = getattr(item, "_fixtureinfo", None)
        for defs in info.name2fixturedefs.values() if info else ():
            sources += [_source(d.func) for d in defs]
        for mark, signs in _MARK_SIGNS.items():
            called = tuple(f"{n}(" for n in helpers.get(module, {}).get(mark, ()))
            if any(sign in src for src in sources for sign in signs + called):
                item.add_marker(getattr(pytest.mark, mark))


# ---------------------------------------------------------------- a GCS emulator
@pytest.fixture(scope="session")
def gcs_emulator():
    """fake-gcs-server from its PyPI wheel on 127.0.0.1, once per test process; gcsfs,
    TensorStore and etils.epath (and processes the tests start) talk to it."""
    from tests import gcs_emulator as emulator

    server = emulator.start()
    yield server
    server.stop()


@pytest.fixture
def gcs_url(gcs_emulator):
    """A fresh, empty ``gs://<bucket>/run`` URL on the emulator (a new bucket each test)."""
    from tests import gcs_emulator as emulator

    return emulator.new_bucket(gcs_emulator) + "/run"


@pytest.fixture(scope="session")
def gcs_bucket(gcs_emulator):
    """One ``gs://<bucket>`` on the emulator for the whole session (shared: use ``gcs_url``
    for a test that needs an empty place of its own)."""
    from tests import gcs_emulator as emulator

    return emulator.new_bucket(gcs_emulator)
