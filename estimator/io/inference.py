"""rewrite_for_inference: compile an inference computation with its variables as constants.

TF's ``tpu.rewrite_for_inference`` read every variable once and marked it constant, so the
compiled TPU program took only the inputs. In JAX the variables are explicit arrays (a Flax
``variables`` dict); this module reads them once to the host and closes over them, so XLA
folds them into the program as constants and the compiled program's only arguments are the
inputs. ``validate_inference_rewrite_for_variables`` checks a program for exactly that.

Example:
  >>> model = MLP()
  >>> variables = model.init(key, x)
  >>> program = estimator.rewrite_for_inference(model.apply, variables=variables)
  >>> logits = program(x)                               # compiled; no variable arguments
  >>> estimator.validate_inference_rewrite_for_variables(program, inputs=[x])   # passes
  >>> plain = jax.jit(model.apply).lower(variables, x)
  >>> estimator.validate_inference_rewrite_for_variables(plain, inputs=[x])
  Traceback (most recent call last):
  RuntimeError: ... takes 4 arguments beyond its 1 input(s) ...

``computation`` takes the variables first (``computation(variables, *inputs)``) when
``variables=`` is given; otherwise it is ``computation(*inputs)`` and the arrays it closes
over are its variables (``jax.jit`` folds closed-over arrays into the program the same way).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from ..core.errors import EstimatorRuntimeError, EstimatorTypeError, EstimatorValueError

PyTree = Any


def _device(device_assignment: Any) -> jax.Device:
    """The device an inference program runs on: replica 0, core 0 of the assignment."""
    if device_assignment is None:
        return jax.devices()[0]
    if isinstance(device_assignment, jax.Device):
        return device_assignment
    if hasattr(device_assignment, "tpu_device"):
        return device_assignment.tpu_device(replica=0, logical_core=0)
    raise EstimatorTypeError(
        "device_assignment must be None, a jax.Device or an estimator.DeviceAssignment, "
        f"got {type(device_assignment).__name__}"
    )


def _read_once(variables: PyTree) -> PyTree:
    """Every variable read from its device once, as a host numpy array."""
    return jax.tree.map(np.asarray, jax.device_get(variables))


class InferenceProgram:
    """An inference computation with its variables folded in; call it with the inputs.

    Compiled once per input shapes (``jax.jit``). ``jitted`` is the underlying jitted
    function of the inputs only (e.g. for ``jax.export``); ``lower(*inputs)`` gives the
    program XLA compiles.
    """

    def __init__(self, fn: Callable, *, name: str, device: jax.Device, num_variables: int | None):
        self.name = name
        self.device = device
        self._num_variables = num_variables
        self._fn = fn
        self.jitted = jax.jit(fn)

    @property
    def num_variables(self) -> int | None:
        """How many variable arrays were folded in (None until traced for closures)."""
        return self._num_variables

    def _placed(self, inputs: Sequence[Any]) -> list:
        sharding = SingleDeviceSharding(self.device)

        def place(x):
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            return jax.device_put(x, self.device)

        return [jax.tree.map(place, x) for x in inputs]

    def __call__(self, *inputs: Any) -> Any:
        return self.jitted(*self._placed(inputs))

    def lower(self, *inputs: Any) -> jax.stages.Lowered:
        """The program for these inputs (arrays or ``jax.ShapeDtypeStruct``), not compiled."""
        placed = self._placed(inputs)
        if self._num_variables is None:
            closed = jax.make_jaxpr(self._fn)(*placed)
            self._num_variables = len(closed.consts)
        return self.jitted.lower(*placed)

    def __repr__(self) -> str:
        return f"InferenceProgram(name={self.name!r}, device={self.device})"


def rewrite_for_inference(
    computation: Callable,
    inputs: Sequence[Any] | None = None,
    device_assignment: Any = None,
    name: str | None = None,
    *,
    variables: PyTree = None,
) -> Any:
    """Rewrites ``computation`` for inference: variables read once and folded in as constants.

    Args:
      computation: ``computation(variables, *inputs)`` when ``variables`` is given, else
        ``computation(*inputs)`` closing over its variables.
      inputs: a list of inputs (pytrees of arrays). Given: the rewritten computation is run
        on them and its outputs are returned, as TF did. None: the rewritten program is
        returned, to call (or lower, or export) later.
      device_assignment: where the program runs: an ``estimator.DeviceAssignment`` (its
        replica 0, core 0), a ``jax.Device``, or None for the first device.
      name: the program's name (it names the compiled module); default the computation's.
      variables: keyword-only; the variables (e.g. a Flax variables dict). They are read
        from the devices once, now, so later changes do not affect the program.

    Returns:
      The outputs of ``computation(*inputs)`` when ``inputs`` is given, else an
      ``InferenceProgram``.

    Example:
      >>> program = estimator.rewrite_for_inference(model.apply, variables=variables)
      >>> program(x)
      >>> estimator.rewrite_for_inference(model.apply, [x], variables=variables)  # run now
    """
    if not callable(computation):
        raise EstimatorTypeError(f"computation must be callable, got {computation!r}")
    if inputs is not None and not isinstance(inputs, (list, tuple)):
        raise EstimatorTypeError(
            f"inputs must be a list of inputs or None, got {type(inputs).__name__}"
        )
    device = _device(device_assignment)
    label = name or getattr(computation, "__name__", None) or "inference"
    label = re.sub(r"\W", "_", str(label))
    if variables is not None:
        folded = _read_once(variables)
        bound = functools.partial(computation, folded)
        num_variables = len(jax.tree.leaves(folded))
    else:
        bound, num_variables = computation, None

    def run(*args: Any) -> Any:
        return bound(*args)

    run.__name__ = run.__qualname__ = label
    program = InferenceProgram(run, name=label, device=device, num_variables=num_variables)
    if inputs is None:
        return program
    return program(*inputs)


# --------------------------------------------------------------------------- validation
def _mlir_main_params(module: Any) -> list[str]:
    for op in module.body.operations:
        if op.operation.name != "func.func":
            continue
        if str(op.attributes["sym_name"]).strip('"') == "main":
            return [str(a.type) for a in op.regions[0].blocks[0].arguments]
    raise EstimatorValueError("the lowered program has no main function")


def _hlo_entry_params(text: str) -> list[str]:
    """Shapes of the ENTRY computation's parameters in compiled HLO text."""
    entry = text[text.index("\nENTRY") :]
    body = entry[: entry.index("\n}")]
    params = re.findall(r"= (\S+) parameter\((\d+)\)", body)
    return [shape for shape, _ in sorted(params, key=lambda p: int(p[1]))]


def _program_params(program: Any, inputs: Sequence[Any] | None) -> list[str]:
    if isinstance(program, InferenceProgram):
        return _mlir_main_params(program.lower(*inputs).compiler_ir("stablehlo"))
    if isinstance(program, jax.export.Exported):
        return [str(a) for a in program.in_avals]
    if isinstance(program, jax.stages.Lowered):
        return _mlir_main_params(program.compiler_ir("stablehlo"))
    if isinstance(program, jax.stages.Compiled):
        return _hlo_entry_params(program.as_text())
    if callable(program):
        return _mlir_main_params(jax.jit(program).lower(*inputs).compiler_ir("stablehlo"))
    raise EstimatorTypeError(
        "program must be an InferenceProgram, a jax.stages.Lowered or Compiled, a "
        f"jax.export.Exported, or a callable; got {type(program).__name__}"
    )


def _inputs_for(program: Any, inputs: Sequence[Any] | None) -> list:
    if inputs is not None:
        if not isinstance(inputs, (list, tuple)):
            raise EstimatorTypeError(
                f"inputs must be a list of inputs, got {type(inputs).__name__}"
            )
        return list(inputs)
    raise EstimatorValueError(
        f"validate_inference_rewrite_for_variables needs inputs=[...] (example arrays or "
        f"jax.ShapeDtypeStruct) to tell a {type(program).__name__}'s inputs from variables"
    )


def validate_inference_rewrite_for_variables(
    program: Any, inputs: Sequence[Any] | None = None
) -> None:
    """Checks that a compiled inference program takes no variables as arguments.

    TF's version checked the graph for the constant markers ``rewrite_for_inference`` adds;
    here the program itself is inspected: its entry function may take the inputs and
    nothing else, so every variable must have been folded in as a constant.

    Args:
      program: an ``InferenceProgram`` (from ``rewrite_for_inference``), a
        ``jax.stages.Lowered`` or ``Compiled``, a ``jax.export.Exported``, or a callable of
        the inputs (lowered with ``jax.jit``).
      inputs: the program's inputs (arrays or ``jax.ShapeDtypeStruct``), as a list; what
        the program takes beyond their leaves are variables.

    Raises:
      RuntimeError: the program takes arguments beyond its inputs (variables were not
        folded in), naming their shapes.
      ValueError: ``inputs`` is missing.

    Example:
      >>> program = estimator.rewrite_for_inference(model.apply, variables=variables)
      >>> estimator.validate_inference_rewrite_for_variables(program, inputs=[x])
    """
    inputs = _inputs_for(program, inputs)
    params = _program_params(program, inputs)
    expected = len(jax.tree.leaves(inputs))
    if len(params) > expected:
        extra = len(params) - expected
        shown = ", ".join(params[:8]) + (", ..." if len(params) > 8 else "")
        raise EstimatorRuntimeError(
            f"Inference rewrite did not fold in the variables: the program takes {extra} "
            f"argument(s) beyond its {expected} input(s) (all arguments: {shown}). Build it "
            "with estimator.rewrite_for_inference(computation, variables=...)"
        )


__all__ = ["InferenceProgram", "rewrite_for_inference", "validate_inference_rewrite_for_variables"]
