"""Reference models the recipes train."""

from lightning_parallel.models.gpt import GPT

__all__ = ["GPT"]
