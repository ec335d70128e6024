"""The local launcher: one child process per host, sharing this machine's devices."""

from __future__ import annotations

import json
import sys
import time

import pytest

from estimator.cli import app as cli
from estimator.cluster import launch


def test_child_envs_share_devices_and_name_the_coordinator():
    base = {"XLA_FLAGS": "--foo --xla_force_host_platform_device_count=8", "PATH": "/bin"}
    envs = launch.child_envs(2, port=4321, base_env=base, timeouts={"heartbeat_timeout": 5})
    for i, env in enumerate(envs):
        assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=4"
        spec = json.loads(env["TF_CONFIG"])
        assert spec["task"] == {"type": "worker", "index": i}
        assert spec["cluster"]["worker"][0] == "127.0.0.1:4321"
        assert env["TPU_ESTIMATOR_HEARTBEAT_TIMEOUT"] == "5" and env["PATH"] == "/bin"
    assert launch.child_envs(4, base_env={})[0]["XLA_FLAGS"].endswith("count=2")
    with pytest.raises(ValueError, match="cannot be shared evenly by num_processes=3"):
        launch.child_envs(3, base_env=base)


def test_cli_hands_num_processes_to_the_launcher(monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "launch_local", lambda n, argv: calls.append((n, argv)) or 0)
    assert cli.main(["train", "--num_processes", "2", "--config.max_steps=4"]) == 0
    assert cli.main(["--num_processes=3", "evaluate"]) == 0
    assert calls == [(2, ["train", "--config.max_steps=4"]), (3, ["evaluate"])]


def test_launcher_kills_the_rest_when_one_fails(tmp_path):
    script = (
        "import json, os, sys, time\n"
        "i = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "sys.exit(3) if i == 1 else time.sleep(60)\n"
    )
    start = time.monotonic()
    rc = launch.launch_local(2, ["-c", script], command=[sys.executable], grace=1, timeout=30)
    assert rc == 3 and time.monotonic() - start < 20


_NOTICE = (
    "[Gloo] Rank {} is connected to {} peer ranks. Expected number of connected peer ranks is : {}"
)


@pytest.mark.parametrize(
    ("lines", "kept"),
    [
        ([_NOTICE.format(0, 1, 1) + "\n", "step 1\n"], ["step 1\n"]),
        # Two threads' notices interleaved piece by piece, as a two-process run printed them.
        (
            [
                _NOTICE.format(1, 1, 1)
                + "[Gloo] Rank "
                + _NOTICE.format(1, 1, 1)
                + " is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
                "\n",
                "1\n",
                _NOTICE.format(3, 7, "") + _NOTICE.format(2, 7, 7) + "\n",
                "7\n",
                "done\n",
            ],
            ["done\n"],
        ),
        # Anything else in a run of notices keeps the whole run.
        (
            ["\n", _NOTICE.format(0, 1, 1) + " and a user's words\n", "3\n"],
            ["\n", _NOTICE.format(0, 1, 1) + " and a user's words\n", "3\n"],
        ),
        (["12\n", "\n"], ["12\n", "\n"]),
    ],
)
def test_launcher_drops_gloo_connect_notices(lines, kept):
    assert list(launch.quiet_gloo(lines)) == kept
