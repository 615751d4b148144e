import math

import pytest
import torch

from gpt2kimi.data import (
    ByteTokenizer,
    builtin_text,
    get_batch,
    lm_batches,
    load_corpus,
    train_val_split,
    unigram_entropy,
)


def test_bytes_round_trip_any_utf8():
    tok = ByteTokenizer()
    for text in ["hello", "naïve — ∑ 🚀", "", "\x00\n\t"]:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode(torch.tensor(ids, dtype=torch.long)) == text
    assert len(tok.encode("é")) == 2  # two UTF-8 bytes
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode([300])


def test_builtin_corpus_is_pythons_documentation():
    text = builtin_text()
    assert 400_000 < len(text) < 600_000
    assert "assert" in text and "while" in text
    corpus = load_corpus()
    assert corpus.vocab_size == 256
    assert len(corpus.train) + len(corpus.val) == len(text.encode("utf-8"))
    assert abs(len(corpus.val) / (len(corpus.train) + len(corpus.val)) - 0.1) < 0.001


def test_load_corpus_from_a_file(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("abc" * 100, encoding="utf-8")
    corpus = load_corpus(path, val_fraction=0.2)
    assert corpus.text == "abc" * 100
    assert len(corpus.val) == 60 and len(corpus.train) == 240


def test_split_and_batches():
    ids = torch.arange(1000)
    train, val = train_val_split(ids, 0.1)
    assert torch.equal(torch.cat([train, val]), ids) and len(val) == 100
    with pytest.raises(ValueError, match="val_fraction"):
        train_val_split(ids, 1.5)
    with pytest.raises(ValueError, match="1-D"):
        train_val_split(ids.view(10, 100))
    g = torch.Generator().manual_seed(0)
    x, y = get_batch(train, batch_size=4, block_size=16, generator=g)
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    with pytest.raises(ValueError, match="block_size"):
        get_batch(torch.arange(10), 2, 10)


def test_lm_batches_are_reproducible():
    corpus = load_corpus()
    a, b = lm_batches(corpus, 2, 8, seed=3), lm_batches(corpus, 2, 8, seed=3)
    for split in ("train", "val", "train"):
        xa, _ = a(split)
        xb, _ = b(split)
        assert torch.equal(xa, xb)
    with pytest.raises(ValueError, match="split"):
        a("test")


def test_unigram_entropy():
    assert unigram_entropy(torch.tensor([7, 7, 7])) == 0.0
    assert math.isclose(unigram_entropy(torch.arange(256)), math.log(256), rel_tol=1e-9)


def test_a_file_that_is_not_utf8_names_the_file_and_the_byte(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"hello \xff world")
    with pytest.raises(ValueError, match="must be a UTF-8 text file") as err:
        load_corpus(path)
    message = str(err.value)
    assert str(path) in message and "offset 6 (0xff)" in message
    assert not isinstance(err.value, UnicodeDecodeError)  # a plain ValueError, not the codec's
    # far into a file (past the chunks read_text decodes at a time) the offset is the file's
    path.write_bytes(b"a" * 100_000 + b"\xc3")
    with pytest.raises(ValueError, match="offset 100000 "):
        load_corpus(path)


def test_the_builtin_corpus_is_shipped_and_checked(tmp_path):
    """The corpus is a file of the project, not the interpreter's docs (which change between
    Python releases); a changed or missing file is a clear error, never other training text."""
    from gpt2kimi.data import CORPUS_PATH

    assert len(builtin_text()) == 465_126  # Python 3.11's topics, sorted by name
    changed = tmp_path / "corpus.txt"
    changed.write_bytes(CORPUS_PATH.read_bytes() + b" ")
    with pytest.raises(ValueError, match="has SHA-256 .* expected .*not the text"):
        builtin_text(changed)
    with pytest.raises(ValueError, match="is missing: it ships with the project"):
        builtin_text(tmp_path / "nowhere.txt")
