"""The storage seam on a local directory and on a bucket (fake-gcs-server on 127.0.0.1)."""

from __future__ import annotations

import os

import pytest

from estimator import storage


@pytest.mark.parametrize(
    "path, want",
    [
        ("gs://bucket/run/", "gs://bucket/run"),
        ("gs://bucket/a/./b/../run", "gs://bucket/a/run"),
        ("GS://bucket/run", "gs://bucket/run"),
        ("gs://bucket", "gs://bucket"),
        ("gs://bucket/", "gs://bucket"),
        ("s3://bucket/x//y", "s3://bucket/x/y"),
    ],
)
def test_absolute_never_makes_a_url_local(path, want):
    assert storage.absolute(path) == want


def test_absolute_of_a_local_path_is_abspath(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.absolute("run") == str(tmp_path / "run")
    assert storage.absolute("file://" + str(tmp_path / "x")) == str(tmp_path / "x")


@pytest.mark.parametrize(
    "path, url", [("gs://b/r", True), ("s3://b/r", True), ("/tmp/r", False), ("file:///r", False)]
)
def test_is_url(path, url):
    assert storage.is_url(path) is url


def test_join_dirname_basename_of_urls():
    assert storage.join("gs://b/run", "eval", "x") == "gs://b/run/eval/x"
    assert storage.dirname("gs://b/run/model.ckpt-4/") == "gs://b/run"
    assert storage.basename("gs://b/run/model.ckpt-4/") == "model.ckpt-4"


@pytest.fixture(params=["local", "bucket"])
def base(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "base")
    return request.getfixturevalue("gcs_url")


def test_files_and_directories_round_trip(base):
    assert not storage.exists(base)
    storage.makedirs(storage.join(base, "d"))
    storage.write_bytes(storage.join(base, "d", "f.bin"), b"\x00\x01")
    storage.write_bytes(storage.join(base, "g.txt"), b"hello")
    assert storage.read_bytes(storage.join(base, "d", "f.bin")) == b"\x00\x01"
    assert storage.read_text(storage.join(base, "g.txt")) == "hello"
    assert sorted(storage.listdir(base)) == ["d", "g.txt"]
    assert storage.isdir(storage.join(base, "d")) and storage.isfile(storage.join(base, "g.txt"))
    assert storage.glob(base, "*.txt") == [storage.join(base, "g.txt")]
    with pytest.raises(FileNotFoundError):
        storage.listdir(storage.join(base, "missing"))
    storage.rmtree(storage.join(base, "d"))
    assert storage.listdir(base) == ["g.txt"]


def test_a_rewritten_file_has_a_new_stamp(base):
    path = storage.join(base, "f")
    storage.makedirs(base)
    assert storage.stamp(path) is None
    storage.write_bytes(path, b"1")
    first = storage.stamp(path)
    storage.write_bytes(path, b"22")
    assert first is not None and storage.stamp(path) != first


def test_staged_directory_is_finished_only_when_uploaded(base):
    final = storage.join(base, "export", "1")
    with pytest.raises(RuntimeError), storage.staged(final) as local:
        with open(os.path.join(local, "half"), "w") as f:
            f.write("x")
        raise RuntimeError("writer died")
    if storage.is_url(base):  # nothing uploaded, nothing marked finished
        assert not storage.finished_step(final)
    with storage.staged(final) as local:
        os.makedirs(os.path.join(local, "sub"))
        with open(os.path.join(local, "sub", "a.txt"), "w") as f:
            f.write("a")
    assert storage.finished_step(final)
    assert storage.read_text(storage.join(final, "sub", "a.txt")) == "a"
    with storage.local_copy(final) as copy:
        with open(os.path.join(copy, "sub", "a.txt")) as f:
            assert f.read() == "a"


def test_a_step_without_its_commit_marker_is_not_finished_on_a_bucket(gcs_url):
    step = storage.join(gcs_url, "model.ckpt-4")
    storage.write_bytes(storage.join(step, "meta", "metadata"), b"{}")
    assert storage.isdir(step) and not storage.finished_step(step)
    storage.write_bytes(storage.join(step, storage.COMMIT_FILE), b"")
    assert storage.finished_step(step)


def test_a_store_without_its_package_is_named_with_the_install_line():
    pytest.importorskip("gcsfs")
    storage.check_backend("gs://bucket/run")  # installed: nothing to say
    try:
        import s3fs  # noqa: F401

        pytest.skip("s3fs is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r"s3fs package: pip install 's3fs'"):
        storage.check_backend("s3://bucket/run")
