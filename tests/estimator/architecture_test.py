"""The package's dependency rules, read from the source: no cycles, layers point one way.

Folders import downward only (``LAYERS``: core < parallel, cluster < data, strategy < engine <
io < weights < driver < facade < cli), nothing but the command line imports the model zoo, and
importing the library configures no logging.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "estimator"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_package(name: str) -> bool:
    return (ROOT / name.replace(".", "/") / "__init__.py").exists()


def _imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports (module level and inside functions), absolute names."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for a in node.names:  # ``from pkg import module`` names a module
                sub = f"{target}.{a.name}"
                out.add(sub if _is_package(target) and _exists(sub) else target)
    return out


def _exists(name: str) -> bool:
    p = ROOT / name.replace(".", "/")
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in PKG.rglob("*.py"):
        name = _module_name(path)
        # The package roots only re-export; an edge to a root is an edge to what it re-exports.
        graph[name] = {m for m in _imports(path) if m.startswith("estimator.")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    inits = {n for n in graph if _is_package(n)}
    edges = {n: {m for m in ms if m in graph and m not in inits} for n, ms in graph.items()}
    found, state, stack = [], {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(edges[n]):
            if state.get(m) == 1:
                found.append(stack[stack.index(m) :] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state and n not in inits:
            visit(n)
    return found


def test_import_graph_has_no_cycles():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]


# The public facade: the only modules at the top of the package besides the command line.
FACADE = (
    "tpu_estimator",
    "train_and_evaluate",
    "tpu",
    "exporters",
    "export",
    "tf_only",
    "summary",  # core/summary under its public name
    "errors",  # core/errors under its public name
)

# The layers, lowest first. A module imports only from its own group or from a lower layer;
# the groups of one layer are siblings and import nothing from each other. Names are module
# folders under ``estimator/`` (the facade's modules excepted); each module has one place.
LAYERS: tuple[tuple[tuple[str, ...], ...], ...] = (
    # The vocabulary every layer uses (errors, configuration, the spec and its contexts), and
    # local paths and bucket URLs (summary's event files and io use them).
    (("core", "storage"),),
    (("parallel",), ("cluster",)),  # the mesh and collectives; the job's processes
    (("data",), ("strategy",)),  # input_fn -> staged calls; the tf.distribute-like API
    (("engine",),),  # the compiled side: model_fn under Flax, the loops, the state
    (("io",),),  # checkpoints, restore, the export format
    (("weights",),),  # init from checkpoints, warm start, variables, moving averages
    (("driver",),),  # the host loops: train, evaluate, predict, export
    (FACADE,),  # the public modules
    (("cli", "__main__"),),  # the command line (the only importer of models)
)


def _place(module: str, layers=LAYERS) -> tuple[int, int] | None:
    """(layer, group) of an ``estimator.*`` module; None for the package root."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    for i, layer in enumerate(layers):
        for j, group in enumerate(layer):
            if parts[1] in group:
                return i, j
    raise AssertionError(f"{module} has no layer: add it to LAYERS in {__file__}")


def _upward(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import that points up a layer or sideways into a sibling group."""
    bad = []
    for n, ms in sorted(graph.items()):
        here = _place(n, layers)
        if here is None:  # estimator/__init__.py re-exports from every layer
            continue
        for m in sorted(ms):
            there = _place(m, layers)
            if there is not None and there != here and there[0] >= here[0]:
                bad.append(f"{n} -> {m}")
    return bad


def test_every_module_has_a_layer():
    placed = {n: _place(n) for n in _graph()}
    assert placed and all(p is not None for n, p in placed.items() if n != "estimator")


def test_every_layer_is_a_folder_and_the_top_is_the_facade():
    folders = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    named = {name for layer in LAYERS for group in layer for name in group}
    assert named - set(FACADE) - {"__main__"} == folders
    top = {p.stem for p in PKG.glob("*.py")} - {"__init__"}
    assert top == set(FACADE) | {"__main__"}, "only the facade at the top: " + str(sorted(top))


def test_layers_point_one_way():
    assert _upward(_graph()) == []


@pytest.mark.parametrize(
    "edge, allowed",
    [
        (("estimator.driver.training", "estimator.engine.loops"), True),  # down
        (("estimator.engine.state", "estimator.engine.loops"), True),  # within a folder
        (("estimator.core.runtime", "estimator.core.compilation"), True),  # within a folder
        (("estimator.engine.state", "estimator.io.store"), False),  # up
        (("estimator.data.feeder", "estimator.engine.model"), False),  # up
        (("estimator.weights.scaffold", "estimator.driver.host"), False),  # up
        (("estimator.data.inputs", "estimator.strategy.strategy"), False),  # sideways
        (("estimator.parallel.mesh", "estimator.cluster.cluster"), False),  # sideways
        (("estimator.driver.job", "estimator.tpu_estimator"), False),  # up to the facade
    ],
)
def test_the_layer_check_tells_down_from_up(edge, allowed):
    n, m = edge
    assert (_upward({n: {m}}) == []) is allowed


def test_only_the_command_line_imports_the_model_zoo():
    importers = set()
    for path in PKG.rglob("*.py"):
        if any(m == "models" or m.startswith("models.") for m in _imports(path)):
            importers.add(_module_name(path))
    assert importers and all(n.startswith("estimator.cli") for n in importers), importers


def test_import_leaves_jax_and_models_out_and_logging_unconfigured():
    code = (
        "import logging, sys, estimator\n"
        "log = logging.getLogger('estimator')\n"
        "print('jax' in sys.modules, 'models' in sys.modules, len(log.handlers),"
        " log.propagate, len(logging.root.handlers))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.split() == ["False", "False", "0", "True", "0"]


def test_only_the_facade_touches_the_estimators_private_members():
    """Drivers take typed collaborators (``driver.job.Job``), never the estimator."""
    import re

    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "tpu_estimator.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if (
                re.search(r"\b(est|estimator)\._[a-z]", line)
                and "estimator.core._compat" not in line
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert offenders == []


MAX_FUNCTION_LINES = 80  # issue 26: a function reads at once


def test_no_function_is_longer_than_a_screen():
    """Every function in ``estimator/``, its docstring included, is at most 80 lines."""
    long = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert long == []


_BUILTIN_RAISES = ("ValueError", "TypeError", "RuntimeError", "KeyError", "IndexError")


def test_deliberate_errors_are_estimator_errors():
    """No bare built-in error is raised in estimator/: each is an ``EstimatorError`` that
    keeps its built-in base (so ``except ValueError`` still works)."""
    offenders = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = getattr(node.exc.func, "id", None)
                if name in _BUILTIN_RAISES:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: raise {name}")
    assert offenders == []


def test_every_error_class_derives_from_estimator_error():
    import importlib
    import inspect

    import estimator

    # Control flow, not errors: Preempted is a SystemExit (the process should end).
    allowed = {"Preempted"}
    found, bad = [], []
    for path in PKG.rglob("*.py"):
        name = _module_name(path)
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != name or not issubclass(cls, BaseException):
                continue
            found.append(cls_name)
            if cls_name not in allowed and not issubclass(cls, estimator.EstimatorError):
                bad.append(f"{name}.{cls_name}")
    assert "NoCheckpointError" in found and bad == []
    assert issubclass(estimator.NoCheckpointError, ValueError)
    assert issubclass(
        estimator.NanLossDuringTrainingError, __import__("hooks").NanLossDuringTrainingError
    )


def _type_checking_imports() -> dict[str, set[str]]:
    """``{".module": {names}}`` imported under ``if TYPE_CHECKING:`` in estimator/__init__.py."""
    tree = ast.parse((PKG / "__init__.py").read_text())
    block = next(
        n
        for n in tree.body
        if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING"
    )
    found: dict[str, set[str]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.dump(node)
        module = "." + (node.module or "")
        found.setdefault(module, set()).update(a.name for a in node.names)
    return found


def test_the_type_checking_block_imports_exactly_the_exports_table():
    """``_EXPORTS`` is the one list of public names; ``__all__`` is derived from it and the
    TYPE_CHECKING block (which type checkers read) must not drift from it."""
    import estimator

    want = {m: set(names) for m, names in estimator._EXPORTS.items()}
    for name, module in estimator._SUBMODULES.items():  # ``from .core import summary``
        want.setdefault(module.rpartition(".")[0] or ".", set()).add(name)
    assert _type_checking_imports() == want
    public = {*estimator._MODULE_OF, *estimator._SUBMODULES}
    assert estimator.__all__ == sorted(n for n in public if not n.startswith("_"))
    assert "_load_global_step_from_checkpoint_dir" in estimator._MODULE_OF  # TF's, not in __all__


def test_lazy_package_exports_every_public_name():
    """Each public name resolves on first use (``import estimator`` imports no JAX: see the
    fresh-process test above) to the object its module defines, and importing a submodule
    does not hide a name it shares."""
    import importlib

    import estimator
    import estimator.train_and_evaluate  # noqa: F401 - the module named like the function

    for module, names in estimator._EXPORTS.items():
        defined = importlib.import_module(module, "estimator")
        for name in names:
            assert getattr(estimator, name) is getattr(defined, name), name
    assert estimator.summary is importlib.import_module("estimator.core.summary")
    assert callable(estimator.train_and_evaluate)
    assert estimator.TPUEstimator.__module__ == "estimator.tpu_estimator"
    with pytest.raises(AttributeError, match="no attribute 'TPUEstimater'"):
        estimator.TPUEstimater  # noqa: B018


@pytest.mark.parametrize("name", ["summary", "errors"])
def test_a_public_submodule_in_core_imports_by_its_public_name(name):
    """``import estimator.summary`` (DESIGN.md's name) is the module in ``core/`` that
    ``estimator.summary`` is, one state, not a copy."""
    module = importlib.import_module(f"estimator.{name}")
    assert module is importlib.import_module(f"estimator.core.{name}")
    assert module is getattr(importlib.import_module("estimator"), name)
