"""Text data for the reference GPT: byte- or char-level tokens from a file, a folder, or the embedded corpus.

The embedded default corpus (``corpus/python_docs.txt.gz``, ~1.4 MB of English prose: the docstrings of CPython's
standard library, PSF licence, rebuilt by ``scripts/build_corpus.py``) ships inside the package, so every recipe
runs offline. Splits are deterministic: the first ``1 - val_fraction`` of the token stream is training data, the
rest validation; samples are non-overlapping windows of ``block_size + 1`` tokens (input and shifted target).
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_parallel.config import UserInputError
from lightning_parallel.data.resumable import ResumableDataModuleMixin

__all__ = ["DEFAULT_CORPUS", "DataError", "TextDataModule", "TokenWindows", "load_text", "tokenize"]

DEFAULT_CORPUS = Path(__file__).with_name("corpus") / "python_docs.txt.gz"
_TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".gz"}


class DataError(UserInputError):
    """A data path or data setting that cannot train (missing, empty, too small); raised before any rank starts."""


def load_text(path: str | Path | None = None) -> str:
    """The text of a file, of every text file under a folder (sorted, joined by blank lines), or of the corpus."""
    p = DEFAULT_CORPUS if path is None else Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data path {str(p)!r} does not exist. Fix: pass a text file or folder, or None for the "
                        "embedded corpus.")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in _TEXT_SUFFIXES)
        if not files:
            raise DataError(f"data path {str(p)!r}: the folder holds no text files ({sorted(_TEXT_SUFFIXES)}). Fix: "
                            "point it at a text file or a folder of them.")
        return "\n\n".join(load_text(f) for f in files)
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    return raw.decode("utf-8", errors="replace")


def tokenize(text: str, level: Literal["byte", "char"]) -> tuple[Tensor, list[str] | None]:
    """Token ids (int64) and, for char level, the sorted vocabulary (ids index into it)."""
    if level == "byte":
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long(), None
    if level == "char":
        vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(vocab)}
        return torch.tensor([index[c] for c in text], dtype=torch.long), vocab
    raise ValueError(f"level={level!r} must be 'byte' or 'char'.")


class TokenWindows(Dataset[tuple[Tensor, Tensor]]):
    """Non-overlapping windows: sample ``i`` is ``tokens[i*T : i*T + T]`` and its next-token targets."""

    def __init__(self, tokens: Tensor, block_size: int) -> None:
        if tokens.numel() < block_size + 1:
            raise ValueError(f"{tokens.numel()} tokens are too few for one window of block_size+1={block_size + 1}.")
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class TextDataModule(ResumableDataModuleMixin, pl.LightningDataModule):
    """Next-token prediction data from text.

    The training order depends on ``seed`` and the epoch only, and global batch ``s`` holds the same samples for
    every data-parallel size (:class:`~lightning_parallel.data.resumable.ResumableSampler`); a run resumed from a
    mid-epoch checkpoint continues with the remaining batches of that epoch.

    Args:
        path: a text file (``.gz`` ok), a folder of text files, or None for the embedded corpus.
        level: ``byte`` (vocab 256, any text) or ``char`` (vocab = the characters of the text).
        block_size: tokens per sample (must not exceed the model's block_size).
        batch_size: samples per batch *per data-parallel rank* (global batch = batch_size x dp).
        val_fraction: tail fraction of the token stream held out for validation.
        num_workers: DataLoader workers. seed: shuffling seed of the training loader.
    """

    def __init__(
        self,
        path: str | None = None,
        level: Literal["byte", "char"] = "byte",
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"data val_fraction={val_fraction} must be in (0, 1), e.g. 0.1.")
        for key, value in (("block_size", block_size), ("batch_size", batch_size)):
            if value < 1:
                raise DataError(f"data {key}={value} must be >= 1 (tokens per sample / samples per batch per "
                                "data-parallel rank).")
        self.save_hyperparameters()
        self.vocab: list[str] | None = None
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None
        self._checked_tokens: tuple[Tensor, list[str] | None] | None = None

    @property
    def _hp(self) -> Any:
        return self.hparams

    @property
    def vocab_size(self) -> int:
        if self._hp.level == "byte":
            return 256
        if self.vocab is None:
            self.setup("fit")
        assert self.vocab is not None
        return len(self.vocab)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        checked, self._checked_tokens = self._checked_tokens, None
        tokens, self.vocab = checked or tokenize(load_text(self._hp.path), self._hp.level)
        n_val = max(self._hp.block_size + 1, int(tokens.numel() * self._hp.val_fraction))
        self.train_set = TokenWindows(tokens[:-n_val], self._hp.block_size)
        self.val_set = TokenWindows(tokens[-n_val:], self._hp.block_size)
        model = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        model_vocab = getattr(getattr(model, "hparams", None), "vocab_size", None)
        if model_vocab is not None and model_vocab < self.vocab_size:
            raise DataError(
                f"the data has {self.vocab_size} distinct tokens ({self._hp.level}-level) but the model's "
                f"vocab_size={model_vocab}. Fix: model vocab_size >= {self.vocab_size}."
            )

    def check_before_launch(self, *, data_parallel_size: int = 1, model: Any = None) -> None:
        """Before any rank starts: the text exists and is not empty, the model's context holds ``block_size``, and
        both splits give at least one batch per data-parallel rank (else training would run 0 steps). Raises
        :class:`DataError` with the numbers and the fix. The tokens are kept for :meth:`setup`."""
        hp = self._hp
        model_block = getattr(getattr(model, "hparams", None), "get", lambda *_: None)("block_size")
        if isinstance(model_block, int) and hp.block_size > model_block:
            raise DataError(f"data block_size={hp.block_size} is longer than the model's block_size={model_block} "
                            f"(its position table). Fix: data block_size <= {model_block}, or a model with "
                            f"block_size >= {hp.block_size}.")
        text = load_text(hp.path)
        where = "the embedded corpus" if hp.path is None else f"data path {hp.path!r}"
        if not text:
            raise DataError(f"{where} is empty (0 bytes of text). Fix: point it at a file with text.")
        tokens, vocab = tokenize(text, hp.level)
        self._checked_tokens = (tokens, vocab)  # setup reuses them in this process instead of reading again
        distinct = 256 if vocab is None else len(vocab)
        model_vocab = getattr(getattr(model, "hparams", None), "get", lambda *_: None)("vocab_size")
        if isinstance(model_vocab, int) and model_vocab < distinct:
            raise DataError(f"the data has {distinct} distinct tokens ({hp.level}-level) but the model's vocab_size="
                            f"{model_vocab}. Fix: model vocab_size >= {distinct}.")
        n_val = max(hp.block_size + 1, int(tokens.numel() * hp.val_fraction))
        train_windows = max(0, (tokens.numel() - n_val - 1) // hp.block_size)
        val_windows = max(0, (n_val - 1) // hp.block_size)
        need = hp.batch_size * data_parallel_size
        if train_windows < need:
            raise DataError(
                f"{where} is too small for one batch per data-parallel rank: {tokens.numel():,} tokens give "
                f"{train_windows} training samples of block_size={hp.block_size} (after {n_val:,} held out for "
                f"validation), but one step needs batch_size {hp.batch_size} x dp {data_parallel_size} = {need}. "
                f"Fix: more text (at least {(need * hp.block_size + n_val + 1):,} tokens), a smaller batch_size or "
                "block_size, or fewer data-parallel ranks."
            )
        if val_windows < 1:
            raise DataError(f"{where}: the validation split ({n_val:,} tokens) holds no sample of block_size="
                            f"{hp.block_size}. Fix: a larger val_fraction or a smaller block_size.")

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        sampler = self.resumable_sampler(self.train_set, self._hp.batch_size, shuffle=True, seed=self._hp.seed)
        return DataLoader(self.train_set, batch_size=self._hp.batch_size, sampler=sampler,
                          num_workers=self._hp.num_workers, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self._hp.batch_size, shuffle=False,
                          num_workers=self._hp.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
