"""The checkpoint errors, apart from every module that raises them (so that none of those modules imports another
only for its error class)."""

from __future__ import annotations

from lightning_parallel.config import UserInputError

__all__ = ["CheckpointFormatError", "ResumeError"]


class CheckpointFormatError(UserInputError):
    """The path is missing, is not a checkpoint of a known format, or is incomplete or corrupt."""


class ResumeError(CheckpointFormatError):
    """A checkpoint that cannot be resumed under the requested layout (the message says why and what to do)."""
