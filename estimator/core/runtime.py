"""Process-wide set-up a RunConfig asks for, and host-side values the programs take."""

from __future__ import annotations

import logging

import jax
import numpy as np

from . import compilation

log = logging.getLogger("estimator")


def setup(config) -> None:
    """Process-wide set-up for ``config``: the persistent compilation cache
    (``estimator.core.compilation``)."""
    compilation.configure_cache(config.compilation_cache_dir)


def seed_key_data(seed: int | None) -> np.ndarray:
    """Raw key data of the base RNG key (uint32[2]); ``None`` means seed 0 so runs are
    reproducible.

    Computed on the host: the same bits as ``jax.random.key_data(jax.random.key(seed))``
    for the default threefry implementation without running (and compiling) a device op.
    """
    seed = 0 if seed is None else int(seed)
    if jax.config.jax_default_prng_impl != "threefry2x32" or not 0 <= seed < 2**31:
        return np.asarray(jax.random.key_data(jax.random.key(seed)))
    return np.array([0, seed], dtype=np.uint32)


#: Up to this many variable elements the init program is compiled unoptimised on CPU.
SMALL_INIT_ELEMENTS = 2_000_000


def init_compiler_options(num_elements: int) -> dict | None:
    """XLA options of the one-off init program: for a small model on CPU, skip the
    optimisation passes and the fusion emitters.

    The init program runs once per job. On XLA:CPU, compiling it optimised costs more than it
    saves for small models (measured: 1.9-4.9 s against 0.4-0.6 s for a 9k-parameter MLP
    with Adam; without the fusion emitters as well, the parity job's init compiled in 0.38 s
    against 0.81 s); for large ones the unoptimised program runs slower (25 M parameters:
    2.5 s against 0.9 s), so they keep the default. The loops keep XLA's defaults: they run
    every step, and the MLP's ran 5% slower without the fusion emitters.
    """
    if jax.default_backend() != "cpu" or num_elements > SMALL_INIT_ELEMENTS:
        return None
    return {
        "xla_backend_optimization_level": 0,
        "xla_llvm_disable_expensive_passes": True,
        "xla_cpu_use_fusion_emitters": False,
    }
