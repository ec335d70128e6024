"""The storage seam: every path under model_dir and the export directories, local or a URL.

A model_dir is a local path or a URL that ``etils.epath`` serves through fsspec: ``gs://``
(gcsfs) first, ``s3://`` (s3fs) where it is installed. Everything the estimator writes or
reads there goes through these functions: local paths keep the plain ``os`` calls (fast, and
atomic renames), URLs go through ``epath``. A URL is never passed to ``os.path.abspath``
(which would make ``gs://b/r`` the local folder ``<cwd>/gs:/b/r``).

What differs on an object store, and who handles it:

* No atomic rename: Orbax writes a step's final directory and marks it finished with
  ``commit_success.txt`` (``finished_step``); exports are written into a local staging
  directory and uploaded (``staged``), then marked finished the same way.
* No append: event files are kept in memory and the whole object is rewritten on each flush
  (``summary.py`` registers that writer with tensorboardX), as TF's GCS file system did.
* No ``flock``: one trainer per model_dir is a lease object with generation preconditions
  (``io/lease.py``).

Example:
  >>> absolute("gs://bucket/run/")
  'gs://bucket/run'
  >>> join("gs://bucket/run", "model.ckpt-100")
  'gs://bucket/run/model.ckpt-100'
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import shutil
import tempfile
from collections.abc import Iterator

from etils import epath

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
COMMIT_FILE = "commit_success.txt"  # Orbax's name for "this directory is finished"


def scheme(path: str | os.PathLike) -> str | None:
    """The URL scheme of ``path`` (``"gs"``), or None for a local path (``file://`` too)."""
    match = _URL.match(os.fspath(path))
    if match is None or match.group(1).lower() == "file":
        return None
    return match.group(1).lower()


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an object store (any ``scheme://`` but ``file://``)."""
    return scheme(path) is not None


def _local(path: str | os.PathLike) -> str:
    text = os.fspath(path)
    return text[len("file://") :] if text.startswith("file://") else text


def absolute(path: str | os.PathLike) -> str:
    """``path`` in one canonical spelling: an absolute local path, or a URL without a
    trailing slash or ``.``/``..`` segments."""
    text = os.fspath(path)
    if not is_url(text):
        return os.path.abspath(_local(text))
    head, rest = text.split("://", 1)
    bucket, _, key = rest.partition("/")
    key = posixpath.normpath("/" + key).lstrip("/") if key.strip("/") else ""
    return f"{head.lower()}://{bucket}" + (f"/{key}" if key else "")


def join(base: str | os.PathLike, *parts: str) -> str:
    """``base`` joined with ``parts`` (``/`` for URLs, ``os.path.join`` for local paths)."""
    base = os.fspath(base)
    if is_url(base):
        return posixpath.join(base, *parts)
    return os.path.join(_local(base), *parts)


def dirname(path: str) -> str:
    return posixpath.dirname(path.rstrip("/")) if is_url(path) else os.path.dirname(path)


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) if is_url(path) else os.path.basename(path)


_BACKENDS = {"gs": ("gcsfs", "tpu-estimator-jax[gcs]"), "s3": ("s3fs", "s3fs")}


def check_backend(path: str | os.PathLike) -> None:
    """Raises a clear error when ``path``'s store needs a package that is not installed.

    Raises:
      ImportError: naming the package and the ``pip install`` that brings it.
    """
    found = scheme(path)
    if found not in _BACKENDS:
        return
    module, package = _BACKENDS[found]
    try:
        __import__(module)
    except ImportError:
        raise ImportError(
            f"{os.fspath(path)!r} is on {found}://, which needs the {module} package: "
            f"pip install '{package}'"
        ) from None


def epath_of(path: str | os.PathLike) -> epath.Path:
    """``path`` as an ``epath.Path`` (what Orbax takes)."""
    return epath.Path(path if is_url(path) else _local(path))


def exists(path: str) -> bool:
    return epath.Path(path).exists() if is_url(path) else os.path.exists(_local(path))


def isdir(path: str) -> bool:
    return epath.Path(path).is_dir() if is_url(path) else os.path.isdir(_local(path))


def isfile(path: str) -> bool:
    return epath.Path(path).is_file() if is_url(path) else os.path.isfile(_local(path))


def listdir(path: str) -> list[str]:
    """The names in directory ``path``.

    Raises:
      FileNotFoundError: there is no such directory (an object-store prefix with nothing
        under it is no directory).
    """
    if not is_url(path):
        return os.listdir(_local(path))
    p = epath.Path(path)
    if not p.is_dir():
        raise FileNotFoundError(path)
    return [child.name for child in p.iterdir()]


def makedirs(path: str) -> None:
    """Creates directory ``path`` and its parents (a no-op on stores without directories)."""
    if is_url(path):
        epath.Path(path).mkdir(parents=True, exist_ok=True)
    else:
        os.makedirs(_local(path), exist_ok=True)


def rmtree(path: str) -> None:
    """Removes directory ``path`` and everything under it, if it is there."""
    if is_url(path):
        p = epath.Path(path)
        if p.exists():
            p.rmtree(missing_ok=True)
    else:
        shutil.rmtree(_local(path), ignore_errors=True)


def rename(src: str, dst: str) -> None:
    """Moves ``src`` to ``dst``: atomic for local paths; a copy then a delete on a store."""
    if is_url(src) or is_url(dst):
        epath.Path(src).rename(epath.Path(dst))
    else:
        os.rename(_local(src), _local(dst))


def read_bytes(path: str) -> bytes:
    if is_url(path):
        return epath.Path(path).read_bytes()
    with open(_local(path), "rb") as f:
        return f.read()


def read_text(path: str) -> str:
    return read_bytes(path).decode()


def write_bytes(path: str, data: bytes) -> None:
    """Writes a whole file (a single object on a store)."""
    if is_url(path):
        epath.Path(path).write_bytes(data)
    else:
        with open(_local(path), "wb") as f:
            f.write(data)


def open_file(path: str, mode: str = "rb"):
    """An open file object for ``path`` (on a store, written when it is closed)."""
    return epath.Path(path).open(mode) if is_url(path) else open(_local(path), mode)  # noqa: SIM115


def glob(directory: str, pattern: str) -> list[str]:
    """Paths in ``directory`` whose names match ``pattern`` (no recursion), sorted."""
    if not is_url(directory):
        import glob as glob_lib

        return sorted(glob_lib.glob(os.path.join(glob_lib.escape(_local(directory)), pattern)))
    p = epath.Path(directory)
    return sorted(str(child) for child in p.glob(pattern)) if p.is_dir() else []


def stamp(path: str) -> tuple | None:
    """What identifies one written file or directory, or None when it is not there: a new
    one written at the same path has another stamp (local: inode and mtime; a store: the
    generation/mtime of its commit marker or the object)."""
    if not is_url(path):
        try:
            st = os.stat(_local(path))
        except OSError:
            return None
        return os.path.realpath(_local(path)), st.st_dev, st.st_ino, st.st_mtime_ns
    p = epath.Path(path)
    target = p / COMMIT_FILE if (p / COMMIT_FILE).exists() else p
    try:
        st = target.stat()
    except (OSError, ValueError):
        return None
    return str(target), getattr(st, "mtime", None), getattr(st, "length", None)


def finished_step(path: str) -> bool:
    """Whether directory ``path`` (a checkpoint step or an export) is complete: on a local
    file system once it has its final name (written under a temporary one, then renamed);
    on a store once it holds its commit marker."""
    if not is_url(path):
        return os.path.isdir(_local(path))
    return (epath.Path(path) / COMMIT_FILE).exists()


@contextlib.contextmanager
def staged(final: str) -> Iterator[str]:
    """A local directory whose files become ``final``'s when the block ends without error.

    For writers that only write local files (TF's SavedModel writer, ``np.savez``): on a
    store the directory is uploaded, then ``COMMIT_FILE`` is written last, so a reader never
    takes a half-uploaded directory for a finished one. A local ``final`` is used as is.
    """
    if not is_url(final):
        os.makedirs(_local(final), exist_ok=True)
        yield _local(final)
        return
    with tempfile.TemporaryDirectory(prefix="tpu_estimator_stage_") as local:
        yield local
        upload_tree(local, final)
        write_bytes(join(final, COMMIT_FILE), b"")


def upload_tree(local: str, remote: str) -> None:
    """Copies the local directory ``local`` to ``remote``, file by file."""
    for root, _, files in os.walk(local):
        rel = os.path.relpath(root, local)
        target = remote if rel == "." else join(remote, *rel.split(os.sep))
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                write_bytes(join(target, name), f.read())


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """A local directory with ``path``'s files (``path`` itself when it is local): for
    readers that only read local files (TF's SavedModel loader)."""
    if not is_url(path):
        yield _local(path)
        return
    with tempfile.TemporaryDirectory(prefix="tpu_estimator_fetch_") as local:
        download_tree(path, local)
        yield local


def download_tree(remote: str, local: str) -> None:
    """Copies every object under ``remote`` into the local directory ``local``."""
    os.makedirs(local, exist_ok=True)
    for child in epath.Path(remote).iterdir():  # one listing per directory, no '**' glob
        target = os.path.join(local, child.name)
        if child.is_dir():
            download_tree(str(child), target)
        else:
            with open(target, "wb") as f:
                f.write(child.read_bytes())
