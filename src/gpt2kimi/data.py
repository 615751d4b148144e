"""Text data for every chapter: a byte-level tokenizer, a built-in corpus, and random batches.

The built-in corpus is the English text of Python's own reference documentation (CPython 3.11's
``pydoc_data.topics``, the topics sorted by name, about 466 KB, PSF licence), shipped with the
project as ``book/data/corpus.txt`` and checked against its SHA-256 at every load: every
interpreter trains on the same text (the topics differ between Python releases: 3.12's are 7%
longer). Nothing is downloaded. A reader can point :func:`load_corpus` at any UTF-8 text file
instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from gpt2kimi.train import seeded_splits

Batch = tuple[torch.Tensor, torch.Tensor]


class ByteTokenizer:
    """Tokens are the 256 possible bytes of UTF-8, so any text round-trips exactly."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ValueError(f"byte ids must lie in [0, 256), got {bad[:5]}")
        # A model may emit a byte sequence that is not valid UTF-8; show it rather than fail.
        return bytes(ids).decode("utf-8", errors="replace")


CORPUS_PATH = Path(__file__).resolve().parents[2] / "book" / "data" / "corpus.txt"
CORPUS_SHA256 = "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"


def builtin_text(path: Path = CORPUS_PATH) -> str:
    """The built-in corpus, Python 3.11's reference documentation, as one string.

    Raises ``ValueError`` if the file is missing or is not the text the book's results were
    recorded on (its SHA-256 differs).
    """
    if not path.exists():
        raise ValueError(
            f"the built-in corpus {path} is missing: it ships with the project (book/data/); "
            "restore it with git, or pass load_corpus a path to your own UTF-8 text"
        )
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != CORPUS_SHA256:
        raise ValueError(
            f"the built-in corpus {path} has SHA-256 {digest}, expected {CORPUS_SHA256}: it is "
            "not the text the book's results were recorded on (restore it with git)"
        )
    return data.decode("utf-8")


@dataclass
class Corpus:
    """A tokenized text split into training and validation ids (1-D ``torch.long`` tensors)."""

    text: str
    tokenizer: ByteTokenizer
    train: torch.Tensor
    val: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def train_val_split(
    ids: torch.Tensor, val_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split 1-D ids into a leading training part and a trailing validation part."""
    if ids.dim() != 1:
        raise ValueError(f"expected 1-D token ids, got shape {tuple(ids.shape)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    n_val = max(1, int(len(ids) * val_fraction))
    return ids[:-n_val], ids[-n_val:]


def load_corpus(path: str | Path | None = None, val_fraction: float = 0.1) -> Corpus:
    """Load the built-in corpus (``path=None``) or a UTF-8 text file, byte-tokenized and split."""
    if path is None:
        text = builtin_text()
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            # read_text decodes in chunks (its offset counts from a chunk): decode the whole file
            raw = Path(path).read_bytes()
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path} is not UTF-8 text: byte at offset {err.start} "
                    f"({raw[err.start]:#04x}) is not valid UTF-8; the training text must be a "
                    "UTF-8 text file"
                ) from err
            raise
    tokenizer = ByteTokenizer()
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    train, val = train_val_split(ids, val_fraction)
    return Corpus(text=text, tokenizer=tokenizer, train=train, val=val)


def get_batch(
    ids: torch.Tensor,
    batch_size: int,
    block_size: int,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> Batch:
    """Sample ``batch_size`` random windows of ``block_size`` tokens.

    Returns inputs ``x`` [B, T] and targets ``y`` [B, T], where ``y`` is ``x`` shifted by one.
    """
    if len(ids) <= block_size:
        raise ValueError(f"need more than block_size={block_size} tokens, got {len(ids)}")
    starts = torch.randint(len(ids) - block_size, (batch_size,), generator=generator)
    x = torch.stack([ids[s : s + block_size] for s in starts.tolist()])
    y = torch.stack([ids[s + 1 : s + 1 + block_size] for s in starts.tolist()])
    return x.to(device), y.to(device)


def lm_batches(
    corpus: Corpus, batch_size: int, block_size: int, seed: int = 0
) -> Callable[[str], Batch]:
    """A batch source for :func:`gpt2kimi.train.train`: ``batches("train")`` or ``batches("val")``.

    Each split draws from its own seeded generator, so a run is reproducible
    (:func:`gpt2kimi.train.seeded_splits`, as every task of the book).
    """
    draws = {
        split: partial(get_batch, ids, batch_size, block_size)
        for split, ids in (("train", corpus.train), ("val", corpus.val))
    }
    return seeded_splits(draws, seed)


def fixed_windows(ids: torch.Tensor, block_size: int, batch_size: int) -> list[Batch]:
    """``ids`` cut into consecutive, non-overlapping windows of ``block_size`` tokens, in order,
    grouped into batches: a fixed evaluation set that depends on no seed.

    Window i reads ``ids[i*T : (i+1)*T]`` and predicts ``ids[i*T+1 : (i+1)*T+1]``, so every token
    but the first is predicted exactly once; the last ``(len(ids) - 1) % T`` tokens are left out.
    Returns ``[(x [b, T], y [b, T]), ...]`` with ``b = batch_size`` (the last batch may be smaller).
    """
    n_windows = (len(ids) - 1) // block_size
    if n_windows < 1:
        raise ValueError(f"need more than block_size={block_size} tokens, got {len(ids)}")
    n = n_windows * block_size
    x = ids[:n].view(n_windows, block_size)
    y = ids[1 : n + 1].view(n_windows, block_size)
    return list(zip(x.split(batch_size), y.split(batch_size), strict=True))


def fixed_val_batches(corpus: Corpus, block_size: int, batch_size: int = 64) -> list[Batch]:
    """The whole validation split as :func:`fixed_windows`: the same batches for every seed and
    every evaluation (pass them to :func:`gpt2kimi.train.train` as ``val_set``)."""
    return fixed_windows(corpus.val, block_size, batch_size)


def unigram_entropy(ids: torch.Tensor) -> float:
    """Entropy in nats of the token frequencies: the loss of the best model that ignores context."""
    counts = torch.bincount(ids.flatten()).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())
