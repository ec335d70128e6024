"""Which compiled calls run a loop: call lengths from ``iterations_per_loop`` and a byte budget.

``iterations_per_loop`` (IPL) is what the user sees: hooks, host_call delivery, logging and
checkpoints happen once per loop of IPL steps. Under it, a loop runs as one or more compiled
calls of at most ``k`` steps, ``k`` chosen so one call's input fits
``TPUConfig.max_staged_input_bytes`` per device, so the input on the devices does not grow
with IPL.

Call lengths come from a small set, so a second ``evaluate`` compiles nothing:

* a loop of ``n`` steps is ``n // k`` calls of ``k`` steps and a tail of ``n % k``;
* in training the tail is one call of exactly ``n % k`` steps (the IPL and the final loop
  decide it, as before);
* in evaluation and prediction, and wherever the input ends inside a call, the tail is split
  into powers of two (13 -> 8 + 4 + 1): no step runs on a batch of padding only, and at most
  ``log2(k) + 2`` programs exist per mode whatever the inputs' lengths (one more where
  evaluation merges loops, below).

Evaluation keeps no state between loops, so when several whole loops fit the budget one call
runs up to ``MAX_LOOPS_PER_CALL`` of them (``loops_per_call``); the hooks still see each loop,
cut where the call says its loops end (``Call.loop_ends``; ``driver/evaluation.py``). Whole
loops left over at the end run as one-loop calls, so this adds one program, not a family.
Prediction keeps one loop per call: its ``iterations_per_loop`` is how many batches the user
waits for before the first results.

Example:
  >>> calls_per_loop(10, 4, exact_tail=True)
  [4, 4, 2]
  >>> calls_per_loop(13, 16, exact_tail=False)
  [8, 4, 1]
  >>> steps_per_call(budget=1024, step_bytes=100, iterations_per_loop=25)
  9
  >>> steps_per_call(budget=2100, step_bytes=100, iterations_per_loop=1000)
  20
  >>> loops_per_call(budget=3000, step_bytes=100, iterations_per_loop=10)
  3
  >>> [c.steps for c in plan_calls(iter([10] * 7 + [5, 0]).__next__, k=10, exact_tail=False,
  ...                                  merge=3)]
  [30, 30, 10, 4, 1]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

from ..core.errors import EstimatorValueError


def powers_of_two(n: int) -> list[int]:
    """``n`` as a sum of distinct powers of two, largest first (``13 -> [8, 4, 1]``)."""
    if n < 0:
        raise EstimatorValueError(f"a step count cannot be negative, got {n}")
    return [1 << b for b in reversed(range(n.bit_length())) if n >> b & 1]


ACCELERATOR_BUDGET = 256 * 2**20  # input bytes per device and call on TPU / GPU
CPU_BUDGET = 2 * 2**20  # per process, shared by its CPU devices
CPU_EVAL_BUDGET = 8 * 2**20  # evaluation: per process, shared by its CPU devices


def input_budget(
    configured: int | None, *, platform: str, local_devices: int, mode: str = "train"
) -> int:
    """``TPUConfig.max_staged_input_bytes`` per device, its default resolved.

    On TPU and GPU the default stages up to 256 MiB per device per call, so a loop's input
    streams in a few calls while the next one transfers. CPU devices all live in host
    memory and a transfer there is a copy with no latency to hide, so the default is 2 MiB
    per process, split over its CPU devices: peak memory at ``iterations_per_loop=1000``
    then stays within 1.3x of IPL 1 for an image model (benchmarks/memory_vs_ipl.py), and
    a small model still runs dozens of steps per call (the MLP benchmark: 25, at 0.96x
    the hand-written ceiling).

    Evaluation (``mode="eval"``) on CPU gets 8 MiB per process: each of its calls also
    brings every step's outputs back to the host for eval_metrics (a wait and a copy per
    call that training does not have), and it holds no gradients or optimizer state, so
    fewer, longer calls pay where training's would not. The MLP evaluation benchmark (IPL
    100, 8 KiB a step per device) runs a loop as 1 call instead of 4: 0.83x -> 0.95x the
    hand-written loop.

    Example:
      >>> input_budget(None, platform="cpu", local_devices=8) == 2**18
      True
      >>> input_budget(None, platform="cpu", local_devices=8, mode="eval") == 2**20
      True
    """
    if configured is not None:
        return configured
    if platform == "cpu":
        per_process = CPU_EVAL_BUDGET if mode == "eval" else CPU_BUDGET
        return max(1, per_process // max(1, local_devices))
    return ACCELERATOR_BUDGET


def steps_per_call(*, budget: int, step_bytes: int, iterations_per_loop: int) -> int:
    """The call length ``k``: as many steps as fit ``budget`` bytes, spread evenly over a loop.

    At least one step per call, whatever the budget. When a loop needs ``c`` calls, ``k``
    divides IPL if that costs at most a quarter more calls (IPL 1000 with room for 21 steps
    runs as 50 calls of 20: one program, not a second one for a 13-step tail); otherwise
    ``k = ceil(IPL / c)`` so the calls have nearly equal lengths (IPL 1000 with room for 300
    steps runs as 4 calls of 250, not 3 of 300 and one of 100).
    """
    fit = max(1, budget // max(1, step_bytes))
    ipl = iterations_per_loop
    if fit >= ipl:
        return ipl
    calls = math.ceil(ipl / fit)
    divisor = next(d for d in range(fit, 0, -1) if ipl % d == 0)
    if ipl // divisor <= calls + calls // 4:
        return divisor
    return math.ceil(ipl / calls)


MAX_LOOPS_PER_CALL = 8  # evaluation: beyond this, fewer calls no longer pay (see loops_per_call)


def loops_per_call(*, budget: int, step_bytes: int, iterations_per_loop: int) -> int:
    """Evaluation: how many whole loops one call runs, 1 to ``MAX_LOOPS_PER_CALL``.

    Every call costs a launch, a transfer and a fetch on the host, which at a short
    ``iterations_per_loop`` (the CNN benchmark's 10) is a tenth of evaluate's time on CPU;
    loops that fit the budget together run as one call. Bounded so the input read before the
    first call stays short, and whole loops left at the end need at most 7 one-loop calls.
    """
    fit = max(1, budget // max(1, step_bytes))
    return max(1, min(MAX_LOOPS_PER_CALL, fit // iterations_per_loop))


def split_steps(n: int, loop: int) -> list[int]:
    """The calls that run ``n`` steps a call was cut to: whole loops of ``loop`` steps, then
    the rest as powers of two (``split_steps(35, 10) == [10, 10, 10, 4, 1]``)."""
    return [loop] * (n // loop) + powers_of_two(n % loop)


def calls_per_loop(n: int, k: int, *, exact_tail: bool) -> list[int]:
    """The call lengths of a loop of ``n`` steps with calls of at most ``k`` steps."""
    if k <= 0:
        raise EstimatorValueError(f"steps per call must be positive, got {k}")
    full, rest = divmod(n, k)
    tail = ([rest] if rest else []) if exact_tail else powers_of_two(rest)
    return [k] * full + tail


class Call(NamedTuple):
    """One compiled call, as the input side plans it, with the loop ends inside it."""

    steps: int  # steps of this call
    loop_steps: int  # planned steps of each loop it runs (or belongs to)
    loop_ends: tuple[int, ...] = ()  # offsets in the call where a loop ends: (k, 2k, 3k)

    @property
    def ends_loop(self) -> bool:
        """Whether its last step ends a loop."""
        return bool(self.loop_ends) and self.loop_ends[-1] == self.steps


def plan_calls(
    next_loop: Callable[[], int], *, k: int, exact_tail: bool, merge: int = 1
) -> Iterator[Call]:
    """The calls of successive loops; ``next_loop()`` gives each loop's steps (<= 0 ends).

    With ``merge > 1`` (evaluation, where ``k`` is the whole loop), ``merge`` loops of ``k``
    steps run as one call; whole loops left when a shorter loop or the end comes run one
    per call. Each call carries where its loops end (``Call.loop_ends``).
    """
    whole = 0  # whole loops waiting to be merged
    while True:
        n = next_loop()
        if merge > 1 and n == k:
            whole += 1
            if whole == merge:
                yield Call(k * merge, k, tuple(k * (i + 1) for i in range(merge)))
                whole = 0
            continue
        for _ in range(whole):
            yield Call(k, k, (k,))
        whole = 0
        if n <= 0:
            return
        lengths = calls_per_loop(n, k, exact_tail=exact_tail)
        for i, steps in enumerate(lengths):
            yield Call(steps, n, (steps,) if i == len(lengths) - 1 else ())
