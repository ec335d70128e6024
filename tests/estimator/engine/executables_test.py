"""engine/executables.py: programs kept by their trace, so a warm process lowers nothing."""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import stages

from estimator.core import compilation
from estimator.core.compilation import CompileCounter
from estimator.engine import executables


@pytest.fixture
def cache(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    path = compilation.configure_cache(str(tmp_path / "cache"))
    try:
        yield path
    finally:
        compilation.configure_cache(before or False)


def _program(scale=2.0, **jit):
    const = np.full((3,), scale, np.float32)  # a constant of the program, not an argument
    return jax.jit(lambda x: jnp.sin(x) * const, **jit)


def _no_lowering(monkeypatch):
    def refuse(self, *a, **k):
        raise AssertionError("lowered although the program was stored")

    monkeypatch.setattr(stages.Traced, "lower", refuse)


def test_a_stored_program_loads_without_lowering_and_computes_the_same(cache, monkeypatch):
    x = jnp.arange(3.0)
    first = executables.load_or_compile(_program(), (x,))
    assert len(os.listdir(executables.cache_dir())) == 1
    with monkeypatch.context() as m:
        _no_lowering(m)
        with CompileCounter() as counter:
            again = executables.load_or_compile(_program(), (x,))  # a new jit, same program
    assert (counter.events, counter.cache_hits, counter.compiled) == (1, 1, 0)
    want = np.sin(np.arange(3.0, dtype=np.float32)) * 2.0
    np.testing.assert_allclose(np.asarray(again(x)), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(first(x)))


def test_an_executable_jax_loaded_from_its_own_cache_is_not_stored(cache):
    # Serialized again, such an XLA:CPU executable loses its code and fails when run.
    x = jnp.arange(3.0)
    want = np.asarray(_program()(x))  # plain jit: JAX's cache has it, this store does not
    out = executables.load_or_compile(_program(), (x,))(x)
    np.testing.assert_array_equal(np.asarray(out), want)
    assert not os.path.exists(executables.cache_dir())


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda: _program(scale=3.0), id="another constant"),
        pytest.param(
            lambda: _program(compiler_options={"xla_backend_optimization_level": 0}),
            id="other compiler options",
        ),
        pytest.param(lambda: _program(donate_argnums=0), id="donated argument"),
    ],
)
def test_what_the_trace_fixes_beyond_its_text_is_in_the_key(cache, other):
    x = jnp.arange(3.0)
    base = executables.program_key(_program().trace(x), (x,))
    assert executables.program_key(_program().trace(x), (x,)) == base
    assert executables.program_key(other().trace(x), (x,)) != base
    assert (
        executables.program_key(_program().trace(jnp.arange(3)), (jnp.arange(3),)) != base
    )  # int32 input


class _State(NamedTuple):
    a: jax.Array
    b: jax.Array


def test_the_container_types_of_arguments_and_results_are_in_the_key(cache):
    """One jaxpr, other trees: an executable loaded for a NamedTuple state must not be
    handed a plain tuple (found by the suite's shared cache: an EMA state met a tuple)."""

    class _State(NamedTuple):  # the same class name, another class
        a: jax.Array
        b: jax.Array

    x = jnp.arange(3.0)
    double = jax.jit(lambda s: jax.tree.map(lambda v: v * 2, s))
    states = [globals()["_State"](x, x), _State(x, x), (x, x)]
    keys = {executables.program_key(double.trace(s), (s,)) for s in states}
    assert len(keys) == 3
    for s in states:  # each stored in turn; each loads as its own tree
        out = executables.load_or_compile(double, (s,))(s)
        assert type(out) is type(s)
        np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(x) * 2)


def test_the_devices_of_a_sharding_are_in_the_key(cache):
    x = jnp.arange(3.0)
    on = [jax.device_put(x, jax.devices()[i]) for i in (0, 1)]
    keys = {executables.program_key(_program().trace(a), (a,)) for a in on}
    assert len(keys) == 2


def test_a_program_with_a_host_callback_is_never_stored(cache):
    seen = []

    def f(x):
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), x)
        return x + 1

    x = jnp.arange(3.0)
    assert executables.program_key(jax.jit(f).trace(x), (x,)) is None
    out = executables.load_or_compile(jax.jit(f), (x,))(x)
    jax.effects_barrier()
    np.testing.assert_array_equal(np.asarray(out), [1.0, 2.0, 3.0])
    assert len(seen) == 1
    assert not os.path.exists(executables.cache_dir())


def test_a_damaged_entry_is_removed_and_compiled_again(cache):
    x = jnp.arange(3.0)
    executables.load_or_compile(_program(), (x,))
    (name,) = os.listdir(executables.cache_dir())
    path = os.path.join(executables.cache_dir(), name)
    with open(path, "wb") as f:
        f.write(b"not a program")
    out = executables.load_or_compile(_program(), (x,))(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_program()(x)))
    # removed; not stored again, as JAX's own cache served the compile (see the test above)
    assert not os.path.exists(path)


def test_entries_beyond_the_bound_go_oldest_first(cache, monkeypatch):
    x = jnp.arange(3.0)
    executables.load_or_compile(_program(scale=1.0), (x,))
    (oldest,) = os.listdir(executables.cache_dir())
    os.utime(os.path.join(executables.cache_dir(), oldest), (1, 1))
    size = os.path.getsize(os.path.join(executables.cache_dir(), oldest))
    monkeypatch.setattr(executables, "MAX_BYTES", int(size * 1.5))
    executables.load_or_compile(_program(scale=5.0), (x,))
    assert oldest not in os.listdir(executables.cache_dir())
    assert len(os.listdir(executables.cache_dir())) == 1


def test_without_a_cache_nothing_is_stored(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    compilation.configure_cache(False)
    try:
        assert executables.cache_dir() is None
        x = jnp.arange(3.0)
        out = executables.call(_program(), x)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(_program()(x)))
    finally:
        compilation.configure_cache(before or False)


# ---------------------------------------------------------------- trust (issue 42, item 6)
_MARKER_PICKLE = """
import os, pickle
class Payload:
    def __reduce__(self):
        return (os.mkdir, ({marker!r},))
with open({path!r}, "wb") as f:
    f.write({prefix!r} + pickle.dumps(Payload()))
"""


def _plant(path: str, marker: str, prefix: bytes = b"") -> None:
    """Writes, in another interpreter, an entry whose unpickling would make ``marker``."""
    code = _MARKER_PICKLE.format(marker=marker, path=path, prefix=prefix)
    exec(compile(code, "<planted entry>", "exec"), {})  # noqa: S102 - builds the bad pickle


@pytest.mark.parametrize(
    "prefix",
    [
        pytest.param(b"", id="an unsigned pickle"),
        pytest.param(executables._MAGIC + b"\0" * 32, id="a wrong signature"),
    ],
)
def test_an_entry_not_signed_with_this_users_key_is_never_unpickled(
    cache, tmp_path, caplog, prefix
):
    x = jnp.arange(3.0)
    program = _program(scale=7.0)
    executables.load_or_compile(program, (x,))
    (name,) = os.listdir(executables.cache_dir())
    entry = os.path.join(executables.cache_dir(), name)
    marker = str(tmp_path / "ran")
    _plant(entry, marker, prefix)
    executables._WARNED.discard("entry")
    with caplog.at_level("WARNING", logger="estimator"):
        out = executables.load_or_compile(_program(scale=7.0), (x,))(x)
    assert not os.path.exists(marker)  # the planted code never ran
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_program(scale=7.0)(x)))
    assert not os.path.exists(entry)  # removed (JAX's own cache served the compile again)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith(f"Compiled program {entry} was not loaded: it is not signed")


def test_the_signing_key_is_made_once_readable_by_this_user_only(cache):
    x = jnp.arange(3.0)
    executables.load_or_compile(_program(scale=9.0), (x,))
    key = executables.key_path(executables.cache_dir())
    assert os.path.dirname(key) == cache
    assert os.stat(key).st_mode & 0o777 == 0o600
    with open(key, "rb") as f:
        assert len(f.read()) == 32
    (name,) = os.listdir(executables.cache_dir())
    with open(os.path.join(executables.cache_dir(), name), "rb") as f:
        assert f.read().startswith(executables._MAGIC)  # signed


def test_a_key_others_can_read_is_not_used(cache, caplog):
    key = executables.key_path(os.path.join(cache, executables.SUBDIR))
    with open(key, "wb") as f:
        f.write(b"k" * 32)
    os.chmod(key, 0o644)
    executables._KEYS.pop(key, None)
    x = jnp.arange(3.0)
    with caplog.at_level("WARNING", logger="estimator"):
        out = executables.load_or_compile(_program(scale=11.0), (x,))(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_program(scale=11.0)(x)))
    assert not os.path.exists(executables.cache_dir())  # nothing stored under that key
    assert any("signing key" in r.getMessage() for r in caplog.records)
    executables._KEYS.pop(key, None)


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("world-writable", id="writable by every user"),
        pytest.param("group-writable", id="writable by the group"),
        pytest.param("another owner", id="owned by another user"),
    ],
)
def test_a_cache_directory_another_user_can_write_is_refused(tmp_path, caplog, how):
    shared = tmp_path / "shared"
    shared.mkdir()
    if how == "another owner":
        if os.geteuid() != 0:
            pytest.skip("changing a directory's owner needs root")
        os.chown(shared, 65534, 65534)
    else:
        os.chmod(shared, 0o777 if how == "world-writable" else 0o770)
    before = jax.config.jax_compilation_cache_dir
    try:
        with caplog.at_level("WARNING", logger="estimator"):
            assert compilation.configure_cache(str(shared)) is None
            assert compilation.configure_cache(str(shared)) is None  # warned once
        assert jax.config.jax_compilation_cache_dir is None
        # Set through JAX directly: the store refuses it all the same.
        jax.config.update("jax_compilation_cache_dir", str(shared))
        assert executables.cache_dir() is None
        x = jnp.arange(3.0)
        out = executables.call(_program(scale=13.0), x)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(_program(scale=13.0)(x)))
        assert not (shared / executables.SUBDIR).exists()
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation.configure_cache(before or False)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"Compilation cache off: {shared} is ")
    assert "another user could place programs there" in warnings[0]
