"""Datasets and DataModules, including the embedded default corpus (the quickstart runs offline)."""

from lightning_parallel.data.resumable import ResumableDataModuleMixin, ResumableSampler
from lightning_parallel.data.text import DEFAULT_CORPUS, DataError, TextDataModule, TokenWindows, load_text, tokenize

__all__ = ["DEFAULT_CORPUS", "DataError", "ResumableDataModuleMixin", "ResumableSampler", "TextDataModule",
           "TokenWindows", "load_text", "tokenize"]
