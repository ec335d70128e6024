"""The real TensorBoard server reads a finished run's train and eval scalars."""

import json
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

import estimator
import hooks
from tests import helpers as h

STARTUP_TIMEOUT = 60  # seconds for the server to print its address
DATA_TIMEOUT = 60  # seconds for it to load the event files


class _LossRecorder(hooks.SessionRunHook):
    def __init__(self):
        self.losses = {}

    def before_run(self, run_context):
        return hooks.SessionRunArgs({"loss": "loss", "step": "global_step"})

    def after_run(self, run_context, run_values):
        r = run_values.results
        self.losses.update(zip(r["step"].tolist(), r["loss"].tolist(), strict=True))


def _tensorboard_binary() -> str:
    binary = Path(sys.executable).with_name("tensorboard")
    if not binary.exists():
        pytest.fail(
            f"the 'tensorboard' command (test extra) is not installed next to {sys.executable}"
        )
    return str(binary)


class _Server:
    """``tensorboard --logdir DIR`` on 127.0.0.1 and an ephemeral port; always stopped."""

    def __init__(self, logdir):
        self.proc = subprocess.Popen(
            [
                _tensorboard_binary(),
                "--logdir",
                str(logdir),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--load_fast=false",
                "--reload_interval",
                "1",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []
        self._port = threading.Event()
        self.port = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.output.append(line)
            m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._port.set()

    def wait_for_port(self) -> int:
        if not self._port.wait(STARTUP_TIMEOUT):
            raise AssertionError(f"tensorboard printed no address: {''.join(self.output)}")
        return self.port

    def get(self, path: str, **query):
        url = f"http://127.0.0.1:{self.port}{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=10) as response:
            return json.loads(response.read().decode())

    def scalars(self, run: str, tag: str) -> list:
        """``[(step, value)]`` once the server has loaded them (polls, bounded)."""
        deadline = time.monotonic() + DATA_TIMEOUT
        while True:
            tags = self.get("/data/plugin/scalars/tags")
            if tag in tags.get(run, {}):
                data = self.get("/data/plugin/scalars/scalars", run=run, tag=tag)
                return [(step, value) for _wall, step, value in data]
            if time.monotonic() > deadline:
                raise AssertionError(f"no {run}/{tag} after {DATA_TIMEOUT}s; tags: {tags}")
            time.sleep(0.5)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def test_tensorboard_serves_train_and_eval_scalars(tmp_path):
    x, y = h.make_data()
    cfg = h.config(tmp_path, iterations_per_loop=2, save_summary_steps=2)
    est = estimator.TPUEstimator(
        h.model_fn, config=cfg, params={}, train_batch_size=16, eval_batch_size=16
    )
    recorder = _LossRecorder()
    est.train(h.train_input_fn(x, y), max_steps=6, hooks=[recorder])
    results = est.evaluate(h.eval_input_fn(x, y))

    server = _Server(tmp_path)
    try:
        server.wait_for_port()
        runs = server.get("/data/runs")
        loss = server.scalars(".", "loss")
        speed = server.scalars(".", "global_step/sec")
        accuracy = server.scalars("eval", "accuracy")
        eval_loss = server.scalars("eval", "loss")
    finally:
        server.stop()
    assert server.proc.returncode is not None

    assert sorted(runs) == [".", "eval"]
    assert [s for s, _ in loss] == [2, 4, 6]
    for step, value in loss:
        assert value == pytest.approx(recorder.losses[step], rel=1e-6)
    assert [s for s, _ in speed] == [4, 6] and all(v > 0 for _, v in speed)
    assert accuracy == [(6, pytest.approx(results["accuracy"], rel=1e-6))]
    assert eval_loss == [(6, pytest.approx(results["loss"], rel=1e-6))]
