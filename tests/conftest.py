"""Test setup: eight simulated CPU devices, set before JAX is imported anywhere."""

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
