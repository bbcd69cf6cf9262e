"""Checkpoints appear whole or not at all: written under a temporary name next to the target, then renamed.

A checkpoint folder (``lp_sharded``, DCP, DeepSpeed) is written by several ranks into ``<name>.partial``; once every
rank is done, rank 0 puts it in place with :func:`replace_with` (the previous checkpoint of that name, such as an older
``last.ckpt``, moved aside to ``<name>.old`` first and removed after). A crash or ``kill -9`` while writing leaves
``<name>.partial`` and the previous ``<name>`` untouched; a crash between the two renames leaves the previous
checkpoint under ``<name>.old`` and the new one complete under ``<name>.partial`` (both whole). One-file checkpoints
are written the same way by Lightning (a temporary file, then a move).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .names import OLD_SUFFIX, PARTIAL_SUFFIX

__all__ = ["PARTIAL_SUFFIX", "fresh_partial", "partial_path", "remove_path", "replace_with"]


def partial_path(target: str | Path) -> Path:
    """Where a checkpoint for ``target`` is written before it is complete: ``<target>.partial``."""
    target = Path(target)
    return target.with_name(target.name + PARTIAL_SUFFIX)


def remove_path(path: Path) -> None:
    """Remove a file, a symlink or a folder tree, if present."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def fresh_partial(target: str | Path) -> Path:
    """An empty ``<target>.partial`` folder (a leftover of an interrupted save removed first)."""
    partial = partial_path(target)
    remove_path(partial)
    partial.mkdir(parents=True)
    return partial


def replace_with(partial: Path, target: str | Path) -> None:
    """Put the complete ``partial`` in place of ``target`` (a file or folder, or nothing yet): ``target`` is moved
    to ``<target>.old``, ``partial`` renamed to ``target``, then ``<target>.old`` removed."""
    target = Path(target)
    old = target.with_name(target.name + OLD_SUFFIX)
    remove_path(old)
    if target.exists() or target.is_symlink():
        os.replace(target, old)
    os.replace(partial, target)
    remove_path(old)
