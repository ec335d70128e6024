"""Every ```python block of README.md and docs/*.md runs as written, unless marked a fragment.

Conventions (also in docs/development.md):

- A ```python block runs on its own, in a fresh namespace.
- ``<!-- fragment -->`` (or ``<!-- fragment: why -->``) on the line before the fence: shown, not
  run (it needs a cluster, TensorFlow, a checkpoint elsewhere, or elides code with ``...``).
- ``<!-- continues -->`` on the line before: runs in (a copy of) the namespace the page's
  previous runnable block left; ``<!-- continues README.md -->`` in the one the README's
  Quick start left (its ``est``, ``train_input_fn``, ``eval_input_fn``, data and imports).

To keep the suite fast, every ``max_steps=N`` literal becomes ``max_steps=max(1, N // 25)``
and ``"/tmp/...`` paths move under pytest's ``tmp_path``. ``DOCS_TEST_AS_WRITTEN=1`` runs the
blocks exactly as written instead (in /tmp, full step counts).

The suite's 8 simulated devices would hide a block that needs them, so every page also runs
in one fresh process with ONE CPU device (the flag removed), as on a newcomer's laptop: each
block must run there too, or fail with an error saying how to get more devices
(``NEEDS_DEVICES``).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
AS_WRITTEN = os.environ.get("DOCS_TEST_AS_WRITTEN") == "1"

_FENCE = re.compile(r"^```(\S*)[^\n]*$")
_MARKER = re.compile(r"^<!--\s*(fragment|continues)\b\s*:?\s*(.*?)\s*-->$")


def python_blocks(page: str) -> list[tuple[int, str, str, str]]:
    """``(line, marker, marker_argument, code)`` of each ```python block of ``page``."""
    lines = (ROOT / page).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        if lang == "python":
            mark = _MARKER.match(lines[start - 1].strip()) if start else None
            kind, arg = (mark.group(1), mark.group(2)) if mark else ("", "")
            blocks.append((start + 1, kind, arg, "\n".join(lines[start + 1 : i]) + "\n"))
        i += 1
    return blocks


def _shorten(code: str, tmp: pathlib.Path) -> str:
    if AS_WRITTEN:
        return code
    code = re.sub(
        r"max_steps=([\d_]+)", lambda m: f"max_steps={max(1, int(m.group(1)) // 25)}", code
    )
    return re.sub(r"([\"'])/tmp/", lambda m: f"{m.group(1)}{tmp}/", code)


_PRINTED: dict[str, str] = {}  # page -> what its blocks printed
_WARNED: dict[str, list[str]] = {}  # page -> the warnings (and errors) its blocks logged


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname}:{record.name}:{record.getMessage()}")


def _run(page: str, line: int, code: str, namespace: dict, tmp: pathlib.Path) -> dict:
    compiled = compile(_shorten(code, tmp), f"{page}:{line}", "exec")
    warned = _Warnings()
    logging.getLogger().addHandler(warned)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            exec(compiled, namespace)  # noqa: S102 - the documentation's own examples
    finally:
        logging.getLogger().removeHandler(warned)
    _PRINTED[page] = _PRINTED.get(page, "") + printed.getvalue()
    _WARNED[page] = _WARNED.get(page, []) + warned.lines
    return namespace


@functools.cache
def _page_namespace(page: str, tmp: str) -> dict:
    """The namespace the last runnable block of ``page`` leaves (each page runs once)."""
    namespace: dict = {}
    for line, kind, arg, code in python_blocks(page):
        if kind == "fragment":
            continue
        if kind == "continues" and arg:
            namespace = dict(_page_namespace(arg, tmp))
        elif kind != "continues":
            namespace = {"__name__": "__docs__"}
        else:
            namespace = dict(namespace)
        namespace = _run(page, line, code, namespace, pathlib.Path(tmp) / page.replace("/", "_"))
    return namespace


@pytest.fixture(scope="module")
def docs_tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("docs"))


def test_markers_are_known_and_blocks_parse():
    for page in PAGES:
        text = (ROOT / page).read_text()
        for comment in re.findall(r"<!--.*?-->", text):
            if re.match(r"<!--\s*(fragment|continues)", comment):
                assert _MARKER.match(comment), f"{page}: malformed marker {comment!r}"
        for line, kind, arg, code in python_blocks(page):
            if kind == "continues" and arg:
                assert arg in PAGES, f"{page}:{line}: continues {arg!r}, not a page"
            if kind != "fragment":
                compile(code, f"{page}:{line}", "exec")  # a syntax error names the line


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)])
def test_runnable_blocks_run(page, docs_tmp):
    if all(kind == "fragment" for _, kind, _, _ in python_blocks(page)):
        pytest.skip(f"{page}: only fragments")
    _page_namespace(page, docs_tmp)


def test_quick_start_trains_evaluates_and_predicts(docs_tmp):
    ns = _page_namespace("README.md", docs_tmp)
    evaluated = ast.literal_eval(_PRINTED["README.md"].strip().splitlines()[-1])
    assert evaluated["global_step"] == (500 if AS_WRITTEN else 500 // 25)  # max_steps reached
    assert evaluated["accuracy"] > (0.98 if AS_WRITTEN else 0.5)  # README: 0.98...
    assert len(ns["predictions"]) == len(ns["x"])


def test_quick_start_logs_no_warning(docs_tmp):
    """A newcomer's first run prints nothing they would take for a fault (issue 42: its own
    input_fn's short batches were warned about)."""
    _page_namespace("README.md", docs_tmp)
    assert _WARNED["README.md"] == []


# Blocks that need more than one device: on one CPU device each must fail at its first line
# that needs them, with an error naming the flag that simulates more.
NEEDS_DEVICES = {"docs/strategy.md": "--xla_force_host_platform_device_count=8"}
_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\d+")
_ONE_DEVICE_CHILD = """
import json, sys
from tests import docs_test
for page in sys.argv[2:]:
    print("RESULT " + json.dumps([page, docs_test.run_page_reporting(page, sys.argv[1])]))
"""


def run_page_reporting(page: str, tmp: str) -> dict:
    """Runs ``page``'s blocks; ``{"ok": True}`` or where and how the first failing block
    failed (``{"ok": False, "line": ..., "error": ...}``)."""
    try:
        _page_namespace(page, tmp)
        return {"ok": True}
    except Exception as e:  # noqa: BLE001 - reported to the parent test
        lines = [f.filename for f in traceback.extract_tb(e.__traceback__)]
        where = [f for f in lines if f.startswith(f"{page}:")]
        return {"ok": False, "line": where[-1] if where else None, "error": f"{e!r}"[:2000]}


@pytest.fixture(scope="module")
def one_device_results(tmp_path_factory):
    """Every page with runnable blocks, in one fresh process with one CPU device."""
    pages = [p for p in PAGES if any(k != "fragment" for _, k, _, _ in python_blocks(p))]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = _DEVICE_FLAG.sub("", env.get("XLA_FLAGS", "")).strip()
    out = subprocess.run(
        [sys.executable, "-c", _ONE_DEVICE_CHILD, str(tmp_path_factory.mktemp("one")), *pages],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    results = dict(
        json.loads(ln.split("RESULT ", 1)[1])
        for ln in out.stdout.splitlines()
        if ln.startswith("RESULT ")
    )
    assert out.returncode == 0 and len(results) == len(pages), out.stderr[-3000:]
    return results


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)])
def test_blocks_run_on_one_cpu_device(page, one_device_results):
    if page not in one_device_results:
        pytest.skip(f"{page}: only fragments")
    got = one_device_results[page]
    if page not in NEEDS_DEVICES:
        assert got["ok"], f"{page} on one CPU device: {got}"
        return
    assert not got["ok"], f"{page} ran on one device: drop it from NEEDS_DEVICES"
    assert NEEDS_DEVICES[page] in got["error"], got


def test_guide_early_stopping_evaluates_at_every_checkpoint(docs_tmp):
    """The guide's train_and_evaluate example evaluates each 200-step checkpoint (not once at
    the end, as with the default 600 s checkpoints), which is what its hook stops on."""
    from hooks.event_reader import read_eval_metrics

    est = _page_namespace("docs/guide.md", docs_tmp)["est"]
    steps = sorted(read_eval_metrics(os.path.join(est.model_dir, "eval")))
    last = 10_000 if AS_WRITTEN else 10_000 // 25
    assert steps[:2] == [200, 400] and steps[-1] < 10_000, steps
    assert AS_WRITTEN or steps == [200, last]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_relative_links_resolve():
    for page in PAGES:
        path = ROOT / page
        text = re.sub(r"```.*?```|`[^`]*`", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{page}: link to {target!r}: no such file"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), f"{page}: link to {target!r}: no such heading"
