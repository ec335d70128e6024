"""A local launcher: N processes on this machine form one job, as N hosts of a pod would.

``tpu-estimator ... --num_processes 2`` (or ``launch_local``) starts the same command N times
on 127.0.0.1. Each child gets its share of the CPU devices (``XLA_FLAGS``
``--xla_force_host_platform_device_count``; 8 in all by default, so 4 each for 2 processes)
and a ``TF_CONFIG`` naming the coordinator (a free port on 127.0.0.1) and its own index, which
``TPUClusterResolver`` reads. The launcher waits for every child; when one fails, the others
get ``grace`` seconds to fail on their own (JAX's heartbeats notice a dead process) and are
then killed, and the launcher returns non-zero.

Any Python program can be launched the same way; a TF-style script needs no change, since
its ``RunConfig`` joins the job ``TF_CONFIG`` describes (``RunConfig(cluster=None)``)::

  python -m estimator.cluster.launch --num_processes 2 -- my_training_script.py --flag=value

Example:
  >>> rc = launch_local(2, ["train", "--model_dir", "/tmp/run", "--config.max_steps=100"])
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import IO

from ..core.errors import EstimatorValueError
from .cluster import TIMEOUT_ENV

DEFAULT_TOTAL_DEVICES = 8
_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
TIMED_OUT = 124


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def strip_num_processes(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--num_processes N`` / ``--num_processes=N`` (what children run)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--num_processes":
            skip = True
        elif not arg.startswith("--num_processes="):
            out.append(arg)
    return out


def _device_split(num_processes: int, total_devices: int | None, xla_flags: str) -> int:
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise EstimatorValueError(f"num_processes must be a positive int, got {num_processes!r}")
    if total_devices is None:
        found = _DEVICE_FLAG.search(xla_flags)
        total_devices = int(found.group(1)) if found else DEFAULT_TOTAL_DEVICES
    if total_devices < num_processes or total_devices % num_processes:
        raise EstimatorValueError(
            f"total_devices={total_devices} CPU devices cannot be shared evenly by "
            f"num_processes={num_processes}"
        )
    return total_devices // num_processes


def child_envs(
    num_processes: int,
    *,
    port: int | None = None,
    total_devices: int | None = None,
    base_env: Mapping[str, str] | None = None,
    timeouts: Mapping[str, int] | None = None,
) -> list[dict[str, str]]:
    """The environment of each child: its CPU devices, TF_CONFIG and runtime timeouts.

    Args:
      num_processes: children to start.
      port: the coordinator's port on 127.0.0.1 (default: a free one).
      total_devices: CPU devices over all children (default: the parent's
        ``--xla_force_host_platform_device_count``, else 8).
      base_env: the environment to extend (default ``os.environ``).
      timeouts: ``TPUClusterResolver`` timeouts in seconds (``initialization_timeout``,
        ``heartbeat_timeout``, ``shutdown_timeout``), passed through environment variables.

    Raises:
      ValueError: the devices cannot be shared evenly, or an unknown timeout name.
    """
    base = dict(os.environ if base_env is None else base_env)
    flags = base.get("XLA_FLAGS", "")
    share = _device_split(num_processes, total_devices, flags)
    flags = " ".join(
        [_DEVICE_FLAG.sub("", flags).strip(), f"--xla_force_host_platform_device_count={share}"]
    ).strip()
    ports = [port or free_port()] + [free_port() for _ in range(num_processes - 1)]
    workers = [f"127.0.0.1:{p}" for p in ports]
    unknown = sorted(set(timeouts or {}) - set(TIMEOUT_ENV))
    if unknown:
        raise EstimatorValueError(
            f"unknown timeouts {unknown}; expected some of {sorted(TIMEOUT_ENV)}"
        )
    envs = []
    for i in range(num_processes):
        env = dict(base, XLA_FLAGS=flags)
        env.setdefault("JAX_PLATFORMS", "cpu")
        env["TF_CONFIG"] = json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
        )
        for name, value in (timeouts or {}).items():
            env[TIMEOUT_ENV[name]] = str(value)
        envs.append(env)
    return envs


def start_local(
    num_processes: int,
    argv: Sequence[str],
    *,
    command: Sequence[str] | None = None,
    log_dir: str | None = None,
    **env_kwargs,
) -> list[subprocess.Popen]:
    """Starts the children and returns them (see ``child_envs`` for ``env_kwargs``).

    Args:
      num_processes: how many.
      argv: arguments after ``command``.
      command: the program (default ``python -m estimator``, the ``tpu-estimator`` command).
      log_dir: write child ``i``'s output to ``<log_dir>/process_<i>.log``; otherwise its
        stdout and stderr are pipes.
    """
    command = list(command or [sys.executable, "-m", "estimator"])
    procs = []
    for i, env in enumerate(child_envs(num_processes, **env_kwargs)):
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
            out = open(os.path.join(log_dir, f"process_{i}.log"), "w")  # noqa: SIM115
            streams = {"stdout": out, "stderr": subprocess.STDOUT}
        else:
            streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        try:
            procs.append(subprocess.Popen([*command, *argv], env=env, text=True, **streams))
        except BaseException:
            kill_all(procs)
            raise
        finally:
            if log_dir is not None:
                out.close()  # the child holds its own copy
    return procs


def _status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal s: 128 + s, as a shell reports it


def kill_all(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILLs the children still running and reaps them."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()


def wait_all(
    procs: Sequence[subprocess.Popen],
    *,
    timeout: float | None = None,
    grace: float = 10.0,
    poll: float = 0.1,
) -> int:
    """Waits for every child; 0 when all succeeded.

    When one fails the others get ``grace`` seconds to end (they should: JAX's heartbeats
    end a job whose process died), then are killed; the first failure's status is returned.
    After ``timeout`` seconds in all every child is killed and 124 returned.
    """
    start = time.monotonic()
    first_failure, failed_at = None, None
    while True:
        codes = [p.poll() for p in procs]
        for rc in codes:
            if rc not in (None, 0) and first_failure is None:
                first_failure, failed_at = _status(rc), time.monotonic()
        if all(rc is not None for rc in codes):
            return first_failure or 0
        now = time.monotonic()
        if failed_at is not None and now - failed_at >= grace:
            kill_all(procs)
            return first_failure
        if timeout is not None and now - start >= timeout:
            kill_all(procs)
            return TIMED_OUT
        time.sleep(poll)


# Gloo (JAX's CPU collectives) prints one notice per context it connects, a dozen in a
# two-process run, from several threads at once: its pieces interleave across lines.
_GLOO_PIECE = re.compile(
    r"\[Gloo\] Rank | is connected to | peer ranks\. |Expected number of connected peer ranks is : "
)
_FRAGMENT = re.compile(r"[\d\s]*")


def quiet_gloo(lines: Iterable[str]) -> Iterator[str]:
    """The lines, less Gloo's "Rank i is connected to n peer ranks" notices.

    A run of lines holding the notices' pieces (and the bare numbers and line ends their
    interleaving leaves) is dropped when nothing else is in it; otherwise it passes whole.
    """
    burst: list[str] = []
    for line in lines:
        if _GLOO_PIECE.search(line) or (burst and _FRAGMENT.fullmatch(line)):
            burst.append(line)
            continue
        yield from _unless_gloo(burst)
        burst = []
        yield line
    yield from _unless_gloo(burst)


def _unless_gloo(burst: list[str]) -> list[str]:
    return [] if _FRAGMENT.fullmatch(_GLOO_PIECE.sub("", "".join(burst))) else burst


def _forward(stream: IO[str], sink: IO[str], prefix: str) -> None:
    for line in quiet_gloo(stream):
        sink.write(prefix + line)
        sink.flush()


def launch_local(
    num_processes: int,
    argv: Sequence[str],
    *,
    command: Sequence[str] | None = None,
    timeout: float | None = None,
    grace: float = 10.0,
    **env_kwargs,
) -> int:
    """Runs ``command argv`` as ``num_processes`` processes of one job and waits for them.

    Process 0's stdout is passed through as it is (so the command prints what it prints in
    one process); every other line is prefixed with ``[process i]``. For the
    ``tpu-estimator`` command a ``--model_dir`` is added when missing: all processes must
    share it.

    Args:
      num_processes: processes to start.
      argv: their arguments.
      command: the program (default ``python -m estimator``).
      timeout: seconds before every child is killed (None: no limit).
      grace: seconds the others get to end after one failed, before they are killed.
      **env_kwargs: ``total_devices``, ``port``, ``timeouts``, ``base_env`` (see
        ``child_envs``).

    Returns:
      0 when every process succeeded; else the first failure's exit status (128 + signal
      for a killed process), or 124 on timeout.
    """
    argv = list(argv)
    if command is None and not any(
        a == "--model_dir" or a.startswith("--model_dir=") for a in argv
    ):
        argv += ["--model_dir", tempfile.mkdtemp(prefix="tpu_estimator_")]
    procs = start_local(num_processes, argv, command=command, **env_kwargs)
    threads = []
    for i, p in enumerate(procs):
        prefix = f"[process {i}] "
        for stream, sink, pre in (
            (p.stdout, sys.stdout, "" if i == 0 else prefix),
            (p.stderr, sys.stderr, prefix),
        ):
            t = threading.Thread(target=_forward, args=(stream, sink, pre), daemon=True)
            t.start()
            threads.append(t)
    try:
        return wait_all(procs, timeout=timeout, grace=grace)
    except KeyboardInterrupt:
        return 130
    finally:
        kill_all(procs)
        for t in threads:
            t.join(timeout=5)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m estimator.cluster.launch --num_processes N [options] -- PROGRAM ARGS...``."""
    parser = argparse.ArgumentParser(
        prog="python -m estimator.cluster.launch",
        description="Run a Python program as N local processes of one JAX job.",
    )
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument(
        "--total_devices", type=int, default=None, help="CPU devices over all processes (default 8)"
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds in all")
    parser.add_argument(
        "--heartbeat_timeout",
        type=int,
        default=None,
        help="seconds after which a silent process counts as dead",
    )
    parser.add_argument(
        "program",
        nargs=argparse.REMAINDER,
        help="what python runs: script.py args, or -m module args",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("give the program to run after --")
    timeouts = (
        {} if args.heartbeat_timeout is None else {"heartbeat_timeout": args.heartbeat_timeout}
    )
    if program[0] == "-m":
        if len(program) < 2:
            parser.error("-m needs a module name")
        command, rest = [sys.executable, "-m", program[1]], program[2:]
    else:
        command, rest = [sys.executable], program
    return launch_local(
        args.num_processes,
        rest,
        command=command,
        timeout=args.timeout,
        total_devices=args.total_devices,
        timeouts=timeouts,
    )


if __name__ == "__main__":
    sys.exit(main())
