"""Where a resumed trainer's input starts: the checkpoint's position, in the new batch size.

A checkpoint's meta counts the input position in pulls (batches taken from the iterator,
``input_pulls``) and, since issue 30, the rows of one pull (``input_rows_per_pull``). A
resume with another ``train_batch_size`` converts the position to examples and fast-forwards
by whole batches of the new size: the same example comes next, for an input that is one
stream of examples cut into ``params['batch_size']`` batches (the usual ``dataset.batch``).
When the examples consumed are not a whole number of new batches, the position is rounded
down (the remainder is read again, never skipped) and a warning says so; a warning names
both batch sizes and the position used in every case, since an input whose order depends on
its batch size cannot be positioned exactly. A checkpoint without ``input_rows_per_pull``
(written before) is fast-forwarded by pulls, as it was. An input restored with
``set_state`` keeps its own state; a warning says that the batch size changed.
The position a checkpoint records is bounded by what its steps can have consumed
(``checked_input_pulls``): a crafted count would fast-forward the input forever.

Example:
  >>> skip = resume_pulls(meta, pulls_per_step=1, rows_per_pull=32, path="/runs/a/ckpt-24")
"""

from __future__ import annotations

import logging

from ..core.errors import CheckpointError

log = logging.getLogger("estimator")

ROWS_KEY = "input_rows_per_pull"
PROCESSES_KEY = "input_processes"


def checked_input_pulls(meta: dict, *, pulls_per_step: int, path: str) -> int:
    """The number of input batches a checkpoint says were consumed, bounded.

    A resumed trainer fast-forwards a deterministic input by this many pulls; a crafted value
    would make it read forever. Each step consumes ``pulls_per_step`` pulls; as many again are
    allowed for short batches skipped in the stream (or exactly ``skipped_pulls`` when the
    meta records them).

    Raises:
      CheckpointError: ``input_pulls`` is not a count, or more than the steps can have used.
    """
    pulls, step = meta.get("input_pulls", 0), int(meta.get("global_step", 0))
    if isinstance(pulls, bool) or not isinstance(pulls, int) or pulls < 0:
        raise CheckpointError(f"checkpoint {path}: meta input_pulls={pulls!r} is not a count")
    skipped = meta.get("skipped_pulls")
    extra = skipped if isinstance(skipped, int) and skipped >= 0 else step * pulls_per_step
    limit = step * pulls_per_step + extra
    if pulls > limit:
        raise CheckpointError(
            f"checkpoint {path}: meta input_pulls={pulls} is more than its {step} steps can "
            f"have consumed ({limit} pulls at most, {pulls_per_step} per step); refusing to "
            "fast-forward the input that far. The meta was edited or written by another "
            "input pipeline: restore an intact checkpoint, or set "
            "RunConfig(resume_input_position=False) to start the input from its beginning."
        )
    return pulls


def resume_pulls(
    meta: dict,
    *,
    pulls_per_step: int,
    rows_per_pull: int | None,
    path: str,
    stateful: bool = False,
    processes: int = 1,
) -> int:
    """The pulls to fast-forward a deterministic input by (see the module docstring).

    Args:
      meta: the checkpoint's JSON meta.
      pulls_per_step: pulls per training step now.
      rows_per_pull: rows of one pull now (None when the batch size is not known).
      path: the checkpoint's directory, for messages.
      stateful: the input is restored with ``set_state`` instead (the count is only checked).

    Raises:
      CheckpointError: ``input_pulls`` is not a count or more than the steps can have used.
    """
    pulls = checked_input_pulls(meta, pulls_per_step=pulls_per_step, path=path)
    saved = meta.get(ROWS_KEY)
    if not pulls or rows_per_pull is None or not isinstance(saved, int) or saved <= 0:
        return pulls
    # Every process pulls as often; the job's rows of one pull are what both runs share.
    saved_procs = meta.get(PROCESSES_KEY, processes)  # older checkpoints: the same job
    if saved * saved_procs == rows_per_pull * processes:
        return pulls
    saved, rows_per_pull = saved * saved_procs, rows_per_pull * processes
    if stateful:
        log.warning(
            "Resuming with another input batch size: %d rows per input batch now, %d when "
            "checkpoint %s was written. The input's own saved state (set_state) is restored "
            "as it is: where it resumes depends on whether that state counts examples or "
            "batches.",
            rows_per_pull,
            saved,
            path,
        )
        return pulls
    examples = pulls * saved
    new, rest = divmod(examples, rows_per_pull)
    skipped = meta.get("skipped_pulls")
    approx = (
        f" {skipped} of the saved batches were short and skipped, so the count of examples "
        "is an upper bound."
        if isinstance(skipped, int) and skipped > 0
        else ""
    )
    again = (
        f" That is not a whole number of batches of {rows_per_pull}: fast-forwarding "
        f"{new} batches ({new * rows_per_pull} examples); the last {rest} examples are read "
        "again."
        if rest
        else f" Fast-forwarding {new} batches of {rows_per_pull}."
    )
    log.warning(
        "Resuming with another input batch size: %d rows per input batch now, %d when "
        "checkpoint %s was written. Its input position, %d batches of %d = %d examples, is "
        "counted in examples.%s%s This is exact for an input that cuts one stream of examples "
        "into params['batch_size'] batches; set RunConfig(resume_input_position=False) to "
        "start the input from its beginning instead.",
        rows_per_pull,
        saved,
        path,
        pulls,
        saved,
        examples,
        again,
        approx,
    )
    return new
