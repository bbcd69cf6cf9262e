"""The checkpoint errors, apart from every module that raises them (so that none of those modules imports another
only for its error class)."""

from __future__ import annotations

from lightning_parallel.config import UserInputError

__all__ = ["CheckpointFormatError", "CheckpointWriteError", "ResumeError", "UnwritableFolderError"]


class CheckpointFormatError(UserInputError):
    """The path is missing, is not a checkpoint of a known format, or is incomplete or corrupt."""


class ResumeError(CheckpointFormatError):
    """A checkpoint that cannot be resumed under the requested layout (the message says why and what to do)."""


class CheckpointWriteError(OSError):
    """A checkpoint (or a run's output folder) that cannot be written: no space left, a file too large, a folder that
    cannot be created or written. The message names the path, and for a full disk the bytes needed and free."""

    every_rank_stops = True
    """Raised on every rank of a save at once (agreed in a collective): the watchdog blames and ends no rank."""

    def __str__(self) -> str:
        return str(self.strerror) if self.strerror else super().__str__()


class UnwritableFolderError(UserInputError):
    """A folder the run writes into (``default_root_dir``, a logger's ``save_dir``, a checkpoint ``dirpath``) that
    cannot be created or written; refused before any rank starts."""
