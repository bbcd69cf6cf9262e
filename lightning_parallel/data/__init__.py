"""Datasets and DataModules, including the embedded default corpus (the quickstart runs offline)."""

from lightning_parallel.data.resumable import ResumableDataModuleMixin, ResumableSampler
from lightning_parallel.data.text import DEFAULT_CORPUS, TextDataModule, TokenWindows, load_text, tokenize

__all__ = ["DEFAULT_CORPUS", "ResumableDataModuleMixin", "ResumableSampler", "TextDataModule", "TokenWindows",
           "load_text", "tokenize"]
