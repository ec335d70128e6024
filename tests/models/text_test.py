"""Character-level text data: sources, split, windows and the three input_fns."""

import codecs

import ml_collections
import numpy as np
import pytest

from models import text


def test_zen_is_the_decoded_zen_of_python():
    zen = text.load_text("zen").decode("utf-8")
    assert zen.startswith("The Zen of Python, by Tim Peters\n\nBeautiful is better than ugly.")
    assert "Namespaces are one honking great idea -- let's do more of those!" in zen
    # `this` stores it rot13-encoded; encoding it back must give an ASCII letter shuffle.
    assert codecs.encode(zen, "rot13").startswith("Gur Mra bs Clguba")


def test_python_reference_is_pydoc_topics_in_sorted_order():
    from pydoc_data import topics

    data = text.load_text("python_reference").decode("utf-8")
    first = sorted(topics.topics)[0]
    assert data.startswith(topics.topics[first])
    assert len(data) > 100_000
    info = text.corpus_info("python_reference")
    assert info["bytes"] == len(data.encode("utf-8")) and len(info["sha256"]) == 16


def test_file_source_and_unknown_source(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("héllo wörld", encoding="utf-8")
    assert text.load_text(str(path)) == "héllo wörld".encode()
    with pytest.raises(FileNotFoundError, match="text_source='nope'"):
        text.load_text("nope")


def test_encode_decode_round_trip_is_byte_level():
    ids = text.encode("a\u00e9")  # é is two UTF-8 bytes
    assert ids.dtype == np.int32 and ids.tolist() == [97, 195, 169]
    assert text.decode(ids) == "a\u00e9"


def test_split_holds_out_the_tail():
    train, held = text.split(bytes(range(100)), 0.1)
    assert train.tolist() == list(range(90)) and held.tolist() == list(range(90, 100))
    with pytest.raises(ValueError, match="eval_fraction"):
        text.split(b"abc", 1.0)


def test_windows_are_non_overlapping_inputs_plus_next_targets():
    w = text.windows(np.arange(23), 5)
    assert w.shape == (4, 6)
    np.testing.assert_array_equal(w[:, 0], [0, 5, 10, 15])
    np.testing.assert_array_equal(w[1], np.arange(5, 11))
    with pytest.raises(ValueError, match="seq_len=30"):
        text.windows(np.arange(23), 30)


def test_input_fns_shapes_shift_and_single_pass():
    cfg = ml_collections.ConfigDict({"text_source": "zen", "seq_len": 16, "eval_fraction": 0.25})
    fns = text.char_lm(cfg)
    train = fns["train"]({"batch_size": 4})
    f, y = next(train)
    assert f.shape == y.shape == (4, 16) and f.dtype == np.int32
    np.testing.assert_array_equal(f[:, 1:], y[:, :-1])  # labels are features shifted by one
    again = text.char_lm(cfg)["train"]({"batch_size": 4})
    np.testing.assert_array_equal(next(again)[0], f)  # deterministic, so resumable

    zen = text.load_text("zen")
    _, held = text.split(zen, 0.25)
    n_windows = (len(held) - 1) // 16
    evals = list(fns["eval"]({"batch_size": 3}))
    assert sum(len(b[0]) for b in evals) == n_windows
    assert text.decode(evals[0][0][0]) == zen[len(zen) - len(held) :][:16].decode()
    preds = list(fns["predict"]({"batch_size": 3}))
    np.testing.assert_array_equal(np.concatenate(preds), np.concatenate([b[0] for b in evals]))
