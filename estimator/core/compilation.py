"""XLA compilation, process-wide: the persistent compilation cache and a compile counter.

The cache is on by default, so a second process running the same job loads every program
from disk instead of compiling it. Where it lives, first match wins:

1. ``RunConfig(compilation_cache_dir=PATH)``; ``False`` turns the cache off, ``True`` (like
   the default ``None``) uses the locations below;
2. the environment variable ``TPU_ESTIMATOR_COMPILATION_CACHE_DIR``: a path, or ``0`` /
   ``off`` / ``false`` / ``no`` / ``none`` to turn the cache off;
3. JAX's own ``jax_compilation_cache_dir``, when something else already set it;
4. ``$XDG_CACHE_HOME/tpu-estimator/jax`` (``~/.cache/tpu-estimator/jax``).

The cache is bounded (``DEFAULT_MAX_BYTES``, least recently used entries go first) unless
``jax_compilation_cache_max_size`` was set. Clear it by deleting the directory. JAX's cache
settings are process-wide: the estimator constructed last decides.

A cached program is code this process runs, so a directory another user could write is not
used: one not owned by this user, or writable by its group or others, turns the cache off
with one warning naming it (every program is compiled instead). A directory the estimator
creates is made ``0700``.

Example:
  >>> config = estimator.RunConfig(compilation_cache_dir=False)   # no persistent cache
  >>> with CompileCounter() as counter:
  ...     est.train(input_fn, max_steps=10)
  >>> counter.compiled, counter.cache_hits
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import stat
import threading
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from .errors import EstimatorTypeError

log = logging.getLogger("estimator")

ENV_VAR = "TPU_ESTIMATOR_COMPILATION_CACHE_DIR"
DEFAULT_MAX_BYTES = 2 << 30  # 2 GiB
_OFF = ("0", "off", "false", "no", "none")
_ACTIVE: list[str | None] = [None]  # the directory this module turned on, if any
_REFUSED: set[str] = set()  # untrusted directories already warned about (once per process)
_REFUSED_LOCK = threading.Lock()

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/tpu-estimator/jax``, or ``~/.cache/tpu-estimator/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tpu-estimator", "jax")


def resolve_cache_dir(setting: Any) -> str | None:
    """The cache directory a ``RunConfig.compilation_cache_dir`` value means (None: off).

    Raises:
      TypeError: ``setting`` is not None, a bool or a path.
    """
    if setting is False:
        return None
    if setting is not None and setting is not True:
        if not isinstance(setting, (str, os.PathLike)):
            raise EstimatorTypeError(
                "RunConfig.compilation_cache_dir must be a path, True, False or None, "
                f"got {setting!r}"
            )
        return os.path.abspath(os.fspath(setting))
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return None if env.lower() in _OFF else os.path.abspath(os.path.expanduser(env))
    theirs = jax.config.jax_compilation_cache_dir
    if theirs and theirs != _ACTIVE[0]:
        return theirs
    return default_cache_dir()


def configure_cache(setting: Any) -> str | None:
    """Points JAX's persistent compilation cache where ``setting`` says; returns the directory
    (None: off).

    Small CPU programs compile in well under JAX's default 1 s threshold and would never be
    cached, so both thresholds are lowered to 0.
    """
    path = resolve_cache_dir(setting)
    current = jax.config.jax_compilation_cache_dir
    if path is not None:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            log.warning("Compilation cache off: cannot create %s (%s)", path, e)
            path = None
    if path is not None and not trusted_dir(path):
        path = None
    if path == current:  # already so (ours, or set by the user through JAX: left alone)
        return path
    if path is None and current is None:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    if path is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        # JAX's size bound needs the filelock package to guard evictions.
        if jax.config.jax_compilation_cache_max_size == -1 and importlib.util.find_spec("filelock"):
            jax.config.update("jax_compilation_cache_max_size", DEFAULT_MAX_BYTES)
    jax_cache.reset_cache()  # JAX opens its cache once; make it reopen at the new place
    _ACTIVE[0] = path
    log.info("Persistent compilation cache %s", f"in {path}" if path else "off")
    return path


def untrusted_reason(path: str) -> str | None:
    """Why another user could place files in the directory ``path``; None when only this
    user (or root) can."""
    if not hasattr(os, "geteuid"):  # no POSIX owners and modes (Windows): not checked
        return None
    try:
        st = os.stat(path)
    except OSError as e:
        return f"not readable ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by another user (uid {st.st_uid}; this process runs as {os.geteuid()})"
    if st.st_mode & 0o022:
        who = {0o020: "its group", 0o002: "every user"}.get(st.st_mode & 0o022, "group and others")
        return f"writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def trusted_dir(path: str) -> bool:
    """Whether programs may be loaded from ``path``; warns once per directory when not.

    A cached program is code that this process runs: a directory another user can write
    could hand it theirs.
    """
    why = untrusted_reason(path)
    if why is None:
        return True
    with _REFUSED_LOCK:
        first = path not in _REFUSED
        _REFUSED.add(path)
    if first:
        log.warning(
            "Compilation cache off: %s is %s, so another user could place programs there "
            "that this process would run; every program is compiled instead. Use a directory "
            "only you can write (chmod go-w %s, or another RunConfig(compilation_cache_dir=...) "
            "or $%s).",
            path,
            why,
            path,
            ENV_VAR,
        )
    return False


@dataclasses.dataclass(eq=False)
class CompileCounter:
    """Counts XLA compilations while active (a context manager, re-entrant per instance).

    JAX reports a persistent-cache hit as a backend compile too, so ``compiled`` (what XLA
    really compiled) is ``events - cache_hits``; ``names`` lists the programs (``jit(loop)``)
    and ``programs`` each compile as ``(name, seconds, cache_hit)``, in the order they ended
    (compiles on other threads included: ``Programs`` compiles some ahead, concurrently).
    """

    events: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    names: list = dataclasses.field(default_factory=list)
    programs: list = dataclasses.field(default_factory=list)

    def compiled_seconds(self) -> float:
        """Seconds spent in compiles XLA really ran (cache hits left out)."""
        return sum(s for _, s, hit in self.programs if not hit)

    @property
    def compiled(self) -> int:
        return self.events - self.cache_hits

    def __enter__(self) -> CompileCounter:
        _LISTENERS.add(self)
        return self

    def __exit__(self, *exc) -> None:
        _LISTENERS.discard(self)


class _Listeners:
    """One pair of JAX monitoring listeners for every active counter, installed once."""

    def __init__(self):
        self._active: set[CompileCounter] = set()
        self._lock = threading.Lock()
        self._installed = False
        # JAX records a cache hit inside the compile it belongs to, on the compiling thread,
        # before that compile's duration: a per-thread flag pairs them.
        self._hit = threading.local()

    def add(self, counter: CompileCounter) -> None:
        with self._lock:
            if not self._installed:
                jax.monitoring.register_event_duration_secs_listener(self._on_duration)
                jax.monitoring.register_event_listener(self._on_event)
                self._installed = True
            self._active.add(counter)

    def discard(self, counter: CompileCounter) -> None:
        with self._lock:
            self._active.discard(counter)

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event != BACKEND_COMPILE:
            return
        hit, self._hit.value = getattr(self._hit, "value", False), False
        name = str(kwargs.get("fun_name", "?"))
        with self._lock:
            for c in self._active:
                c.events += 1
                c.seconds += duration
                c.names.append(name)
                c.programs.append((name, duration, hit))

    def _on_event(self, event: str, **_) -> None:
        if event != CACHE_HIT:
            return
        self._hit.value = True
        with self._lock:
            for c in self._active:
                c.cache_hits += 1


_LISTENERS = _Listeners()
