"""Compiled programs kept by their traced program, so a warm process skips lowering.

JAX's persistent compilation cache is keyed by the lowered program: a warm process still
traces and lowers every program to find it (for the digits MLP job, 0.3-0.4 s of a 1.3 s
job). Here a program is keyed by what its trace already fixes: the jaxpr's text, the values
of its constants, the jit parameters (shardings, layouts, donation, compiler options), the
devices of every sharding, JAX's trace-time configuration, the JAX, jaxlib and backend
versions and ``XLA_FLAGS``. A hit loads the serialized executable and lowers nothing; a miss
lowers and compiles as JAX would (JAX's own cache still applies) and stores the executable
beside JAX's entries, in ``<cache dir>/estimator-executables``.

Used only while a persistent compilation cache is configured (``estimator.core.compilation``),
in a job of one process.
A program with a host callback is never stored (its executable holds a Python function that
cannot be serialized, and the jaxpr's text names it without its address). A hit is
reported to JAX's monitoring as a persistent-cache hit and a compile event, so
``CompileCounter`` counts it as JAX's own hits are counted. An entry that fails to load is
removed and the program compiled again. The entries are bounded (``MAX_BYTES``, oldest
first).

An entry is unpickled, so it must come from this user: the store is used only in a cache
directory ``compilation.trusted_dir`` accepts (owned by this user, not writable by group or
others), and every entry is signed with HMAC-SHA256 under a key only this user can read
(``key_path``: 32 random bytes, mode 0600, made on first use in the cache directory). An
entry whose signature does not match (written by someone else, or by an older version,
unsigned) is never unpickled: it is removed, with one warning per process, and the program
compiled again.

Example:
  >>> compiled = load_or_compile(jax.jit(f), (x,))   # lowers nothing when warm
  >>> compiled(x)
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pickle
import re
import secrets
import stat
import threading
import time
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

from ..core import compilation
from ..core.compilation import BACKEND_COMPILE, CACHE_HIT

log = logging.getLogger("estimator")

SUBDIR = "estimator-executables"
KEY_FILE = "estimator-executables.key"
MAX_BYTES = 1 << 30  # 1 GiB of entries; the oldest go first beyond it
_CALLBACK = re.compile(r"\b\w*callback\[")
_JAX_HIT = threading.local()  # set when JAX's own cache served this thread's compile
_LISTENING: list = []
_LISTEN_LOCK = threading.Lock()
_MAGIC = b"tpu-estimator executable, signed\n"
_KEY_BYTES = 32
_KEYS: dict[str, bytes | None] = {}  # key file -> its key (None: unusable), read once
_KEY_LOCK = threading.Lock()
_WARNED: set[str] = set()  # what was warned about once per process
_WARN_LOCK = threading.Lock()


def cache_dir() -> str | None:
    """Where entries go: beside JAX's persistent cache, or None when that is off (and in a
    job of several processes, where loading a program spanning them is not tested here)."""
    base = jax.config.jax_compilation_cache_dir
    if not base or jax.process_count() > 1 or not compilation.trusted_dir(base):
        return None
    return os.path.join(base, SUBDIR)


def call(jitted: Any, *args: Any) -> Any:
    """``jitted(*args)``, through ``load_or_compile`` while a cache is configured."""
    if cache_dir() is None or not hasattr(jitted, "trace"):  # off, or compiled already
        return jitted(*args)
    return load_or_compile(jitted, args)(*args)


def load_or_compile(jitted: Any, args: tuple) -> Any:
    """``jitted``'s executable for ``args`` (arrays or ``jax.ShapeDtypeStruct``s): loaded
    when this trace was compiled before, else lowered, compiled and stored."""
    traced = jitted.trace(*args)
    where = cache_dir()
    key = None if where is None else _safe_key(traced, args)
    if key is None:
        return traced.lower().compile()
    path = os.path.join(where, key)
    start = time.perf_counter()
    compiled = _load(path)
    if compiled is not None:
        _touch(path)  # the bound removes the least recently used entries first
        jax.monitoring.record_event(CACHE_HIT)
        jax.monitoring.record_event_duration_secs(
            BACKEND_COMPILE, time.perf_counter() - start, fun_name=f"jit({traced.fun_name})"
        )
        return compiled
    compiled = _compile(traced)
    if compiled is not None:
        _store(where, path, compiled)
        return compiled
    return traced.lower().compile()  # JAX loaded it from its own cache (see _compile)


def _compile(traced: Any) -> Any:
    """A fresh compile of ``traced``, or None when JAX loaded its executable from its own
    persistent cache instead: an XLA:CPU executable loaded that way serializes without
    its code (it loads, then fails with 'Function ... not found'), so only fresh ones are
    stored. JAX reports the hit on the compiling thread."""
    _listen()
    _JAX_HIT.value = False
    compiled = traced.lower().compile()
    return None if _JAX_HIT.value else compiled


def _listen() -> None:
    with _LISTEN_LOCK:
        if not _LISTENING:
            jax.monitoring.register_event_listener(_on_event)
            _LISTENING.append(True)


def _on_event(event: str, **_) -> None:
    if event == CACHE_HIT:
        _JAX_HIT.value = True


def _safe_key(traced: Any, args: tuple) -> str | None:
    try:
        return program_key(traced, args)
    except Exception as e:  # noqa: BLE001 (JAX internals moved: compile as JAX would)
        log.debug("No key for program %s (%s): compiled without the store", traced.fun_name, e)
        return None


def program_key(traced: Any, args: tuple) -> str | None:
    """A digest of everything the traced program's executable depends on (``args``: what
    it was traced with, for their shardings); None for a program that must not be stored
    (a host callback)."""
    text = str(traced.jaxpr)
    if _CALLBACK.search(text):
        return None
    params = {k: v for k, v in traced._params.items() if k != "jaxpr"}
    shardings = [getattr(a, "sharding", None) for a in jax.tree.leaves(args)]
    h = hashlib.sha256()
    for part in (
        text,
        repr(sorted(params.items())),
        repr(traced.in_avals),
        # The executable is loaded with these trees: two programs with one jaxpr may differ
        # only in a container's type (a NamedTuple of state against a plain tuple).
        repr((_tree_text(traced.in_tree), _tree_text(traced.out_tree))),
        repr([(s, _devices(s)) for s in shardings]),
        repr([_devices(s) for s in params.get("in_shardings", ())]),
        repr([_devices(s) for s in params.get("out_shardings", ())]),
        _context(),
    ):
        h.update(part.encode())
        h.update(b"\0")
    for const in [*traced.jaxpr.consts, *traced._consts]:
        value = np.asarray(const)
        h.update(repr((value.dtype, value.shape)).encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def _tree_text(treedef: Any) -> Any:
    """A treedef with each node's type named in full (its repr gives only the class name)."""
    node = treedef.node_data()
    if node is None:
        return "*"
    kind, aux = node
    return (
        kind.__module__,
        kind.__qualname__,
        repr(aux),
        [_tree_text(c) for c in treedef.children()],
    )


def _devices(sharding: Any) -> Any:
    mesh = getattr(sharding, "mesh", None)
    devices = getattr(mesh, "devices", None)
    if devices is not None:
        return tuple(int(d.id) for d in np.asarray(devices).flat)
    if hasattr(sharding, "device_set"):
        return tuple(sorted(int(d.id) for d in sharding.device_set))
    return None


def _context() -> str:
    """The process-wide settings a program's executable also depends on."""
    client = jax.devices()[0].client
    devices = [(d.id, d.process_index, d.device_kind) for d in jax.devices()]
    trace_context = re.sub(r" at 0x[0-9a-f]+", "", repr(jax._src.config.trace_context()))
    return repr(
        (
            jax.__version__,
            jaxlib.__version__,
            client.platform,
            client.platform_version,
            devices,
            jax.process_index(),
            os.environ.get("XLA_FLAGS", ""),
            trace_context,
        )
    )


def key_path(where: str) -> str:
    """The signing key's file for the entries in ``where``: beside them, in the cache
    directory that ``compilation.trusted_dir`` accepted (JAX's eviction removes only its own
    ``*-cache`` files)."""
    return os.path.join(os.path.dirname(where), KEY_FILE)


def _warn_once(what: str, message: str, *args: Any) -> None:
    with _WARN_LOCK:
        first = what not in _WARNED
        _WARNED.add(what)
    if first:
        log.warning(message, *args)


def _signing_key(where: str) -> bytes | None:
    """This user's key for ``where`` (made on first use), or None when it cannot be made or
    trusted."""
    path = key_path(where)
    with _KEY_LOCK:  # programs compile ahead on other threads
        if path not in _KEYS:
            try:
                _KEYS[path] = _read_key(path)
            except OSError as e:
                log.info("Compiled programs are not kept: no signing key at %s (%s)", path, e)
                _KEYS[path] = None
        return _KEYS[path]


def _read_key(path: str) -> bytes | None:
    if not os.path.lexists(path):
        _create_key(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        key = f.read(_KEY_BYTES + 1)
    mine = not hasattr(os, "geteuid") or st.st_uid == os.geteuid()
    if not stat.S_ISREG(st.st_mode) or not mine or st.st_mode & 0o077 or len(key) != _KEY_BYTES:
        _warn_once(
            path,
            "Compiled programs are not kept: the signing key %s is not a %d-byte file only "
            "this user can read (mode %o); remove it and a new one is made",
            path,
            _KEY_BYTES,
            stat.S_IMODE(st.st_mode),
        )
        return None
    return key


def _create_key(path: str) -> None:
    """Writes a new key whole (a temporary file linked into place), so a process starting
    at the same moment reads either none or all of it; the first link wins."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(_KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        _remove(tmp)


def _signature(key: bytes, path: str, payload: bytes) -> bytes:
    """The entry's HMAC, over its name too: a signed entry moved to another name fails."""
    return hmac.new(key, os.path.basename(path).encode() + b"\0" + payload, "sha256").digest()


def _verified_payload(path: str, data: bytes, key: bytes) -> bytes | None:
    """The pickled payload of a signed entry; None (and a warning once) when it is not."""
    if data.startswith(_MAGIC):
        mac = data[len(_MAGIC) : len(_MAGIC) + 32]
        payload = data[len(_MAGIC) + 32 :]
        if hmac.compare_digest(mac, _signature(key, path, payload)):
            return payload
    _warn_once(
        "entry",
        "Compiled program %s was not loaded: it is not signed with this user's key (%s), so "
        "it may not be this user's (or was written by an older version); it is removed and "
        "the program compiled again",
        path,
        key_path(os.path.dirname(path)),
    )
    return None


def _load(path: str) -> Any:
    key = _signing_key(os.path.dirname(path))
    if key is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.debug("Compiled program %s not read (%s): compiling it again", path, e)
        return None
    payload = _verified_payload(path, data, key)
    if payload is None:  # never unpickled: unpickling runs code
        _remove(path)
        return None
    try:
        device_ids, payload = pickle.loads(payload)
        by_id = {d.id: d for d in jax.devices()}
        devices = [by_id[i] for i in device_ids]  # the program's own device assignment
        return serialize_executable.deserialize_and_load(*payload, execution_devices=devices)
    except Exception as e:  # noqa: BLE001 (a damaged or stale entry: compile again)
        log.debug("Compiled program %s not loaded (%s): compiling it again", path, e)
        _remove(path)
        return None


def _store(where: str, path: str, compiled: Any) -> None:
    key = _signing_key(where)
    if key is None:
        return
    try:
        device_ids = [d.id for d in compiled._executable._unloaded_executable.device_list]
        payload = pickle.dumps((device_ids, serialize_executable.serialize(compiled)))
        os.makedirs(where, mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(_MAGIC + _signature(key, path, payload) + payload)
        os.replace(tmp, path)  # readers see a whole entry or none
        _bound(where)
    except Exception as e:  # noqa: BLE001 (not storable here: it still runs)
        log.debug("Compiled program not stored in %s: %s", where, e)


def _bound(where: str) -> None:
    """Removes the oldest entries while the directory holds more than ``MAX_BYTES``."""
    entries = []
    with os.scandir(where) as it:
        for e in it:
            if e.is_file() and not e.name.endswith(".tmp"):
                st = e.stat()
                entries.append((st.st_mtime, st.st_size, e.path))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries):
        if total <= MAX_BYTES:
            break
        _remove(p)
        total -= size


def _touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
