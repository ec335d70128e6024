"""Tests for hooks.event_reader against TensorBoard's own reader."""

import logging
import os
import struct

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboardX import SummaryWriter
from tensorboardX.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

from hooks import event_reader, read_eval_metrics


def _write_evals(eval_dir, evals, suffix=""):
    """Writes {step: {tag: value}} as tensorboardX scalars plus some non-scalar noise."""
    with SummaryWriter(eval_dir, filename_suffix=suffix) as writer:
        for step, metrics in evals.items():
            for tag, value in metrics.items():
                writer.add_scalar(tag, value, step)
            writer.add_histogram("noise", np.arange(10), step)
            writer.add_text("note", f"step {step}", step)


def _tensorboard_scalars(eval_dir):
    acc = event_accumulator.EventAccumulator(eval_dir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    results = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            results.setdefault(event.step, {})[tag] = event.value
    return dict(sorted(results.items()))


def _event_file(eval_dir):
    (path,) = event_reader.event_files(eval_dir)
    return path


def test_matches_tensorboard(tmp_path):
    rng = np.random.default_rng(0)
    evals = {
        int(step): {"accuracy": float(rng.random()), "loss": float(rng.random() * 3)}
        for step in (100, 200, 300, 1000)
    }
    _write_evals(str(tmp_path), evals)
    got = read_eval_metrics(str(tmp_path))
    assert got == _tensorboard_scalars(str(tmp_path))
    assert list(got) == [100, 200, 300, 1000]
    for step, metrics in evals.items():
        assert got[step] == pytest.approx(metrics, rel=1e-6)  # stored as float32


def test_later_files_override_and_merge(tmp_path):
    _write_evals(str(tmp_path), {10: {"loss": 1.0, "accuracy": 0.5}, 20: {"loss": 0.5}}, ".a")
    _write_evals(str(tmp_path), {20: {"loss": 0.25}, 30: {"loss": 0.125}}, ".b")
    assert len(event_reader.event_files(str(tmp_path))) == 2
    assert read_eval_metrics(str(tmp_path)) == {
        10: {"loss": 1.0, "accuracy": 0.5},
        20: {"loss": 0.25},
        30: {"loss": 0.125},
    }


def test_missing_or_empty_dir(tmp_path):
    assert read_eval_metrics(str(tmp_path / "nope")) == {}
    assert read_eval_metrics(str(tmp_path)) == {}


def _record_ends(data):
    """Byte offsets where each TFRecord of ``data`` ends (12-byte header, 4-byte footer)."""
    ends, pos = [], 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        pos += 12 + length + 4
        ends.append(pos)
    return ends


def test_truncated_last_record(tmp_path):
    full = tmp_path / "full"
    evals = {step: {"loss": step / 8} for step in range(1, 6)}
    with SummaryWriter(str(full)) as writer:
        for step, metrics in evals.items():
            writer.add_scalar("loss", metrics["loss"], step)
    data = open(_event_file(str(full)), "rb").read()
    ends = _record_ends(data)
    assert ends[-1] == len(data) and len(ends) == 6  # file_version + 5 scalars
    cut_dir = tmp_path / "cut"
    os.makedirs(cut_dir)
    cut_path = os.path.join(cut_dir, "events.out.tfevents.1.host")
    # Every cut, byte by byte: exactly the complete records are read.
    for cut in range(len(data) + 1):
        with open(cut_path, "wb") as f:
            f.write(data[:cut])
        complete = sum(end <= cut for end in ends) - 1  # minus the file_version event
        assert read_eval_metrics(str(cut_dir)) == dict(list(evals.items())[: max(complete, 0)])
    # TensorBoard's reader agrees at cuts in the header, the data and the footer.
    for end in ends[1:4]:
        for cut in (end - 1, end - 4, end - 10, end + 5, end + 13):
            with open(cut_path, "wb") as f:
                f.write(data[:cut])
            assert read_eval_metrics(str(cut_dir)) == _tensorboard_scalars(str(cut_dir)), cut


def test_corrupt_record_stops_with_warning(tmp_path, caplog):
    _write_evals(str(tmp_path), {1: {"loss": 1.0}, 2: {"loss": 2.0}})
    path = _event_file(str(tmp_path))
    data = bytearray(open(path, "rb").read())
    data[-6] ^= 0xFF  # inside the last record's data
    open(path, "wb").write(bytes(data))
    with caplog.at_level(logging.WARNING, logger="estimator"):
        got = read_eval_metrics(str(tmp_path))
    assert 1 in got
    assert any("Corrupt record" in r.getMessage() for r in caplog.records)


def _tensor_value(tag, dtype, **fields):
    shape = tensor_shape_pb2.TensorShapeProto()
    tensor = tensor_pb2.TensorProto(dtype=dtype, tensor_shape=shape, **fields)
    return summary_pb2.Summary.Value(tag=tag, tensor=tensor)


def test_tensor_encoded_scalars(tmp_path):
    bf16_bits = int(np.array(2.5, np.float32).view(np.uint32)) >> 16
    values = [
        _tensor_value("f32", types_pb2.DT_FLOAT, float_val=[1.5]),
        _tensor_value(
            "f64_content", types_pb2.DT_DOUBLE, tensor_content=np.float64(0.125).tobytes()
        ),
        _tensor_value("f32_content", types_pb2.DT_FLOAT, tensor_content=np.float32(-3).tobytes()),
        _tensor_value(
            "f16", types_pb2.DT_HALF, half_val=[int(np.array(0.5, np.float16).view(np.uint16))]
        ),
        _tensor_value("bf16", types_pb2.DT_BFLOAT16, half_val=[bf16_bits]),
        _tensor_value("i64", types_pb2.DT_INT64, int64_val=[7]),
        _tensor_value("string", types_pb2.DT_STRING, string_val=[b"x"]),
    ]
    with SummaryWriter(str(tmp_path)) as writer:
        writer._get_file_writer().add_summary(summary_pb2.Summary(value=values), 5)
    assert read_eval_metrics(str(tmp_path)) == {
        5: {
            "f32": 1.5,
            "f64_content": 0.125,
            "f32_content": -3.0,
            "f16": 0.5,
            "bf16": 2.5,
            "i64": 7.0,
        }
    }
    # TensorBoard agrees on the float ones.
    acc = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    from tensorboard.util import tensor_util

    for tag, value in [("f32", 1.5), ("f64_content", 0.125), ("f32_content", -3.0)]:
        (event,) = acc.Tensors(tag)
        assert float(tensor_util.make_ndarray(event.tensor_proto)) == value


def _record(data: bytes) -> bytes:
    """One TFRecord with valid checksums around ``data``."""
    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", event_reader._masked_crc(header))
        + data
        + struct.pack("<I", event_reader._masked_crc(data))
    )


def _with_foreign_record(eval_dir):
    """Event files whose second record checksums fine but is not an Event (issue 30, 2)."""
    _write_evals(eval_dir, {1: {"loss": 1.0}, 2: {"loss": 2.0}})
    path = _event_file(eval_dir)
    data = open(path, "rb").read()
    first = _record_ends(data)[1]
    foreign = _record(b"\xff\xff\xff\xff not an Event protocol buffer")
    open(path, "wb").write(data[:first] + foreign + data[first:])
    return path


def test_a_checksummed_record_that_is_not_an_event_is_skipped_with_one_warning(tmp_path, caplog):
    path = _with_foreign_record(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="estimator"):
        got = read_eval_metrics(str(tmp_path))  # raised DecodeError before
        again = read_eval_metrics(str(tmp_path))
    assert got == again == {1: {"loss": 1.0}, 2: {"loss": 2.0}}
    warned = [r.getMessage() for r in caplog.records if "not Event protocol" in r.getMessage()]
    assert len(warned) == 1 and path in warned[0]  # once, naming the file, not per read


def test_early_stopping_reads_past_a_record_that_is_not_an_event(tmp_path):
    import hooks
    from tests.hooks._fakes import FakeSession

    class Est:
        model_dir = str(tmp_path)

        def eval_dir(self):
            return str(tmp_path / "eval")

    _with_foreign_record(Est().eval_dir())
    hook = hooks.stop_if_lower_hook(Est(), "loss", 1.5, run_every_secs=0.0)
    hook.begin()
    ctx = hooks.SessionRunContext(None, FakeSession(), steps=[3])
    hook.after_run(ctx, hooks.SessionRunValues(None))  # raised DecodeError before
    assert ctx.stop_requested  # loss 1.0 at step 1 is below 1.5
