"""The tail of an evaluation or prediction: a masked full-length call or calls of its own.

When the input ends inside a call of ``n`` planned steps with ``r`` real ones, two ways run
the ``r`` steps (``data/plan.py``):

* **split**: whole loops, then powers of two (``split_steps``: 29 of 32 at IPL 4 runs
  ``4 x 7 + 1``): no step computes on padding, but each length not run before is one more
  program to compile;
* **padded**: the planned call itself with its last ``n - r`` steps all padding (masked
  out: every real example is still counted once, ``driver/eval_loss.py``): one program, the
  one the full calls use, and ``n - r`` steps of wasted device time.

``pad_tail`` picks the cheaper one from what this estimator measured: the seconds its first
call of a new length took (tracing and compiling: the device work is queued, not waited
for) and the device seconds per step of calls whose program already existed
(``CallCosts``). Before any step time is known (the tail is in the first call), padding wins
where it saves programs and adds at most ``UNMEASURED_PAD_STEPS`` steps per program saved;
ties go to the split (no wasted steps). The padding is paid again by every evaluate that
ends the same way, the compile once: the padding steps already run count against padding
(the ski-rental rule), so repeated evaluations compile the tail's programs once the padding
they wasted would have paid for them, and run it split from then on. Training never
pads: a padded train step would still update the state (docs/design.md, "Tail calls").

Example:
  >>> pad_tail(29, 32, 4, compiled=set(), compile_s=None, step_s=None)   # 1 program, not 2
  True
  >>> pad_tail(29, 32, 4, compiled={32, 4, 1}, compile_s=0.5, step_s=0.01)   # all exist
  False
  >>> pad_tail(3, 200, 200, compiled=set(), compile_s=None, step_s=None)   # 197 padding
  False
  >>> pad_tail(7, 32, 4, compiled={32}, compile_s=None, step_s=None)   # 25 steps, 3 programs
  True
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..data import plan

log = logging.getLogger("estimator")

# Before a step was timed: how many padding steps are taken as cheaper than one program's
# compile. An assumption, chosen so that padding at most one merged eval call of 8 loops of
# 4 steps saves a program: a rolled eval loop compiles in about the same time whatever its
# length (the parity MLP's: 0.5-0.9 s on a loaded CPU), far more than 32 of its steps.
UNMEASURED_PAD_STEPS = 32


def pad_tail(
    real: int,
    planned: int,
    loop: int,
    *,
    compiled: set[int],
    compile_s: float | None,
    step_s: float | None,
    padded: int = 0,
) -> bool:
    """Whether ``real`` steps of a call planned at ``planned`` run padded to it (True) or
    split into calls of their own (False, ``plan.split_steps(real, loop)``).

    Args:
      real: the steps with input (``0 < real < planned``).
      planned: the call's planned length.
      loop: ``iterations_per_loop``.
      compiled: the call lengths whose program exists already.
      compile_s: seconds one new program costs (None: not measured yet).
      step_s: device seconds per step (None: not measured yet).
      padded: padding steps earlier tails of this program family already ran.
    """
    split = set(plan.split_steps(real, loop))
    new_split = len(split - compiled)
    new_pad = 0 if planned in compiled else 1
    if step_s is None or compile_s is None:
        saved = new_split - new_pad
        return saved > 0 and planned - real <= UNMEASURED_PAD_STEPS * saved
    waste = (padded + planned - real) * step_s
    return waste + new_pad * compile_s < new_split * compile_s


class CallCosts:
    """What one program family (a mode and batch size) cost so far: the call lengths it
    compiled, the seconds those compiles took and the device seconds per step.

    ``launched`` is called around every call (a new length's call blocks while it traces and
    compiles), ``finished`` when a call's outputs are on the host. Thread-safe: the prefetch
    thread reads it (``pad``) while the driver writes it.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.lengths: set[int] = set()
        self.compile_s: list[float] = []
        self._step_sum, self._step_count = 0.0, 0
        self._last_done: float | None = None
        self.padded = 0  # padding steps the tails chosen padded have run

    @property
    def step_s(self) -> float | None:
        """The mean device seconds per step of the measured calls (None: none yet)."""
        return self._step_sum / self._step_count if self._step_count else None

    def launched(self, steps: int, seconds: float) -> bool:
        """Records a call of ``steps`` whose launch took ``seconds``; True if it was new."""
        with self._lock:
            if steps in self.lengths:
                return False
            self.lengths.add(steps)
            self.compile_s.append(seconds)
            return True

    def ahead(self, steps: int) -> Callable[[float], None]:
        """A program for ``steps`` is compiling ahead (``engine/ahead.py``): it counts as
        existing from now on (its compile is paid already); the function returned records its
        compile seconds once done."""
        with self._lock:
            self.lengths.add(steps)

        def done(seconds: float) -> None:
            with self._lock:
                self.compile_s.append(seconds)

        return done

    def finished(self, steps: int, at: float, *, new: bool) -> None:
        """A call of ``steps`` steps had its outputs on the host at time ``at``; the time since
        the previous call's is its device time when the devices were busy all along. Calls
        of a new program are left out (their time is mostly compiling)."""
        with self._lock:
            last, self._last_done = self._last_done, at
            if new or last is None or steps <= 0:
                return
            self._step_sum += max(0.0, at - last)
            self._step_count += steps

    def pad(self, real: int, planned: int, loop: int) -> bool:
        """``pad_tail`` with what was measured so far."""
        with self._lock:
            compile_s = max(self.compile_s) if self.compile_s else None
            padded = pad_tail(
                real,
                planned,
                loop,
                compiled=set(self.lengths),
                compile_s=compile_s,
                step_s=self.step_s,
                padded=self.padded,
            )
            if padded:
                self.padded += planned - real
            elif self.padded and set(plan.split_steps(real, loop)) - self.lengths:
                log.info(
                    "The input's last %d steps now run as calls of their own (compiled once): "
                    "the %d padding steps earlier calls ran have cost about as much as that "
                    "compile",
                    real,
                    self.padded,
                )
            return padded


def measured(
    costs: CallCosts, launch: Callable[[Any], Any], fetched: Callable[[Callable], Iterator]
) -> Iterator:
    """``fetched(timed_launch)``'s ``(chunk, outputs)`` pairs, each call's costs recorded in
    ``costs``: its launch time (new lengths: tracing and compiling) and when its outputs
    were on the host. A chunk's length is its host mask's rows (padding steps included)."""
    new: set[int] = set()

    def timed_launch(chunk):
        start = time.perf_counter()
        out = launch(chunk)
        steps = chunk.host_mask.shape[0]
        if costs.launched(steps, time.perf_counter() - start):
            new.add(steps)
        return out

    for chunk, outs in fetched(timed_launch):
        steps = chunk.host_mask.shape[0]
        costs.finished(steps, time.perf_counter(), new=steps in new)
        new.discard(steps)
        yield chunk, outs


__all__ = ["CallCosts", "measured", "pad_tail"]
