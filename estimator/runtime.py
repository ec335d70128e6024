"""Process-wide set-up a RunConfig asks for: the persistent compilation cache."""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger("estimator")
_CACHE_DIR: list[str] = []


def setup(config) -> None:
    """Turns on JAX's persistent compilation cache when the config asks for it.

    Small CPU programs compile in well under JAX's default 1 s threshold and would never be
    cached, so the threshold is lowered to 0 (see the JAX notes, section 9).
    """
    cache = config.compilation_cache_dir
    if not cache:
        return
    if cache is True:
        cache = os.path.join(config.model_dir, "compilation_cache")
    cache = os.path.abspath(str(cache))
    if _CACHE_DIR and _CACHE_DIR[0] == cache:
        return
    os.makedirs(cache, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _CACHE_DIR[:] = [cache]
    log.info("Persistent compilation cache in %s", cache)


def seed_key_data(seed: int | None) -> jax.Array:
    """Raw key data of the base RNG key; ``None`` means seed 0 so runs are reproducible."""
    return jax.random.key_data(jax.random.key(0 if seed is None else seed))
