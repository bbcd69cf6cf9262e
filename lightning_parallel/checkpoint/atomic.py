"""Checkpoints appear whole or not at all: written under a temporary name next to the target, then renamed.

A checkpoint folder (``lp_sharded``, DCP, DeepSpeed) is written by several ranks into ``<name>.partial``; once every
rank is done, rank 0 puts it in place with :func:`replace_with` (the previous checkpoint of that name, such as an older
``last.ckpt``, moved aside to ``<name>.old`` first and removed after). A crash or ``kill -9`` while writing leaves
``<name>.partial`` and the previous ``<name>`` untouched; a crash between the two renames leaves the previous
checkpoint under ``<name>.old`` and the new one complete under ``<name>.partial`` (both whole). One-file checkpoints
are written the same way by Lightning (a temporary file, then a move).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from .errors import CheckpointWriteError, UnwritableFolderError
from .names import OLD_SUFFIX, PARTIAL_SUFFIX

__all__ = ["PARTIAL_SUFFIX", "check_writable_dir", "check_writable_file", "disk_errors", "fresh_partial",
           "interrupted_saves", "partial_path", "remove_path", "replace_with"]

_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_WRITE_FAILED = ("unexpected pos", "failed writing", "file write failed", "no space left", "file too large")
"""How torch's zip writer (``torch.save``, DCP's shard writer) reports a write the disk refused."""


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


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_dir(folder: str | Path, *, what: str) -> None:
    """Raise :class:`~.errors.UnwritableFolderError` when ``folder`` (existing, or to be created) cannot be written:
    a file is in the way, or the nearest existing folder is not writable (read-only file system, permissions).
    ``what`` names the setting (``trainer.default_root_dir``, ...) for the message."""
    path = Path(folder)
    base = _existing_ancestor(path)
    if not base.is_dir():
        raise UnwritableFolderError(f"{what}={str(folder)!r} cannot be created: {base} is a file, not a folder. Fix: "
                                    "point it at a folder (or remove the file).")
    if not os.access(base, os.W_OK | os.X_OK) or _read_only(base):
        reason = "is on a read-only file system" if _read_only(base) else "is not writable by this user"
        raise UnwritableFolderError(f"{what}={str(folder)!r} cannot be written: {base} {reason}. Fix: point it at a "
                                    "folder you can write, or fix the folder's permissions.")


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_writable_file(file: str | Path) -> None:
    """Raise ``OSError`` naming the path when ``file`` cannot be created (a parent that is a file, a read-only or
    unwritable folder)."""
    path = Path(file)
    blocking = next((a for a in path.parents if a.exists() and not a.is_dir()), None)
    if blocking is not None:
        raise NotADirectoryError(errno.ENOTDIR, "a parent of the output path is a file, not a folder", str(blocking))
    base = _existing_ancestor(path.parent)
    if _read_only(base):
        raise OSError(errno.EROFS, "read-only file system", str(base))
    if not os.access(base, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "permission denied (the folder is not writable by this user)", str(base))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)  # torch DCP's CheckpointException: {rank: (exception, trace)}
        if isinstance(failures, dict):
            todo.extend(f[0] for f in failures.values() if isinstance(f, tuple) and f)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)


def disk_full_cause(exc: BaseException, folder: str | Path, needed: int | None = None) -> str | None:
    """``"no space left on device"`` / ``"file too large"`` when ``exc`` (or what it wraps) is a write the disk
    refused -- an ``OSError`` with ENOSPC/EFBIG/EDQUOT, or torch's zip writer's "unexpected pos" once the file
    system holds fewer free bytes than ``needed`` -- else None."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _FULL:
            return "file too large" if e.errno == errno.EFBIG else "no space left on device"
    text = " ".join(str(e).lower() for e in _chain(exc))
    if any(marker in text for marker in _WRITE_FAILED):
        free = _free_bytes(folder)
        if free is not None and (needed is None or free < needed or free == 0):
            return "no space left on device"
    return None


def _free_bytes(folder: str | Path) -> int | None:
    try:
        return int(shutil.disk_usage(_existing_ancestor(Path(folder))).free)
    except OSError:
        return None


def disk_full_message(cause: str, path: str | Path, needed: int | None) -> str:
    free = _free_bytes(path)
    need = f"it needs about {needed:,} bytes" if needed else "its size is unknown"
    have = f", the file system has {free:,} bytes free" if free is not None else ""
    return (f"{cause} while writing the checkpoint {path}: {need}{have}. Nothing was put in place of the previous "
            "checkpoint of that name. Fix: free space on that disk, or save elsewhere (ModelCheckpoint(dirpath=...),"
            " trainer.default_root_dir)")


@contextlib.contextmanager
def disk_errors(path: str | Path, *, needed: int | None = None) -> Iterator[None]:
    """Around a checkpoint write: a write the disk refused (full, file too large) becomes a
    :class:`CheckpointWriteError` naming the path, the bytes needed and the bytes free; anything else passes."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        cause = disk_full_cause(exc, Path(path).parent, needed)
        if cause is None:
            raise
        raise CheckpointWriteError(errno.ENOSPC if "space" in cause else errno.EFBIG,
                                   disk_full_message(cause, path, needed), str(path)) from None


def interrupted_saves(folders: list[Path]) -> list[Path]:
    """The ``<name>.partial`` and ``<name>.old`` left under ``folders`` by saves that were cut short (a crash,
    ``kill -9``, a full disk): a ``.partial`` is an incomplete new checkpoint, an ``.old`` the previous one moved
    aside by a rename that did not finish."""
    found: set[Path] = set()
    for folder in folders:
        if folder.is_dir():
            found.update(_leftovers_under(folder))
    return sorted(found)


_LEFTOVER_DEPTH, _LEFTOVER_FOLDERS = 6, 20_000


def _leftovers_under(folder: Path) -> list[Path]:
    """The ``.partial`` entries and the ``.old`` checkpoints (``*.ckpt.old``: files or folders) under ``folder``, found
    where checkpoints go -- at most ``_LEFTOVER_DEPTH`` folders deep (``<root>/<logger>/version_<n>/checkpoints/
    <name>`` is 4), outside hidden folders, and in at most ``_LEFTOVER_FOLDERS`` folders: a run started in a large
    tree (a home folder, the default ``default_root_dir`` being the working directory) must not wait on a walk of all
    of it."""
    found: list[Path] = []
    visited = 0
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        depth = len(here.relative_to(folder).parts)
        for name in (*dirs, *files):
            if name.startswith("."):
                continue
            # a ".old" is a checkpoint moved aside (a "*.ckpt" file or folder), not any backup of the user's
            if name.endswith(PARTIAL_SUFFIX) or (name.endswith(OLD_SUFFIX)
                                                 and name[: -len(OLD_SUFFIX)].endswith(".ckpt")):
                found.append(here / name)
        visited += 1
        if visited >= _LEFTOVER_FOLDERS:
            break
        # a leftover is not searched inside; hidden folders and those too deep are not entered
        dirs[:] = [d for d in dirs if not d.startswith(".") and not d.endswith((PARTIAL_SUFFIX, OLD_SUFFIX))
                   and depth < _LEFTOVER_DEPTH]
    return found
