"""Verify a checkpoint file before it is loaded: empty, truncated, foreign, or changed since it was written.

``torch.save`` writes a zip archive (stored, not compressed) whose every record -- the pickle and one record per
tensor storage -- carries a CRC-32 checksum; ``torch.load`` does not check them, so a flipped byte inside a weight
loads and trains. :func:`verify_torch_file` reads the archive's records against their checksums (about 1 GB/s) and
refuses, naming the file and the record, and -- for a tensor's record -- the tensor (the state-dict key whose bytes
have the checksum the damaged record has now). It also tells an empty file, a truncated one (a zip archive whose
index, written last, is missing) and one that is not a torch archive at all apart, each with one message.

A folder's files are checked against its :data:`~lightning_parallel.checkpoint.names.MANIFEST_FILE`
(:func:`write_manifest` when saving, :func:`verify_folder` before loading); a DCP folder without it is refused unless
:data:`UNVERIFIED_ENV` says to load it unverified. This module imports no format module:
the format modules use it for every file they load.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, Protocol

from .errors import CheckpointFormatError
from .names import DCP_METADATA_FILE, LAYOUT_FILE, MANIFEST_FILE

__all__ = ["MANIFEST_FILE", "UNVERIFIED_ENV", "require_manifest", "verify_folder", "verify_folder_on_rank_zero",
           "verify_torch_file", "write_manifest"]

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header: 30 bytes


def _error(message: str) -> Exception:
    return CheckpointFormatError(message)


def _raw_crc(file: Path, info: zipfile.ZipInfo) -> int:
    """CRC-32 of a record's bytes as they are now (stored records: the bytes after the local header)."""
    with open(file, "rb") as fh:
        fh.seek(info.header_offset)
        header = _LOCAL_HEADER.unpack(fh.read(_LOCAL_HEADER.size))
        name_len, extra_len = header[-2], header[-1]
        fh.seek(info.header_offset + _LOCAL_HEADER.size + name_len + extra_len)
        crc, left = 0, info.compress_size
        while left:
            chunk = fh.read(min(left, 1 << 22))
            if not chunk:
                break
            crc, left = zlib.crc32(chunk, crc), left - len(chunk)
    return crc


def _tensor_with_crc(file: Path, crc: int) -> str | None:
    """The state-dict key of the tensor whose storage bytes have checksum ``crc`` (weights-only load)."""
    import torch

    try:
        content: Any = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # the pickle record itself may be the damaged one
        return None

    def walk(prefix: str, value: Any) -> str | None:
        if isinstance(value, torch.Tensor):
            raw = torch.empty(0, dtype=torch.uint8)
            raw.set_(value.untyped_storage())
            data = raw.numpy().tobytes()
            return prefix if zlib.crc32(data) == crc else None
        if isinstance(value, dict):
            for key, item in value.items():
                found = walk(f"{prefix}.{key}" if prefix else str(key), item)
                if found:
                    return found
        if isinstance(value, list | tuple):
            for i, item in enumerate(value):
                found = walk(f"{prefix}[{i}]", item)
                if found:
                    return found
        return None

    return walk("", content)


def verify_torch_file(file: str | Path, *, expected: str = "a checkpoint written by trainer.save_checkpoint") -> None:
    """Raise :class:`~lightning_parallel.checkpoint.errors.CheckpointFormatError` for a file that is empty,
    truncated, not a torch archive, or whose records fail their checksums; return quietly otherwise."""
    path = Path(file)
    size = path.stat().st_size
    if size == 0:
        raise _error(f"{path}: 0 bytes (an empty file: a save that never wrote anything?); expected {expected}.")
    with open(path, "rb") as fh:
        head = fh.read(4)
    if not zipfile.is_zipfile(path):
        if head == b"PK\x03\x04":
            raise _error(f"{path}: truncated: a torch archive of {size:,} bytes whose end (the index written last) "
                         f"is missing, as a copy or save cut short leaves it; expected {expected}. Fix: use the "
                         "previous checkpoint, or copy the file again.")
        raise _error(f"{path}: not a checkpoint: torch.save writes a zip archive and this file is none (it starts "
                     f"with bytes {head.hex(' ')}); expected {expected}.")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
            info = archive.getinfo(bad) if bad else None
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise _error(f"{path}: a damaged torch archive ({err}); expected {expected}.") from err
    if bad is None or info is None:
        return
    now = _raw_crc(path, info)
    tensor = _tensor_with_crc(path, now) if "/data/" in bad else None
    what = f"the bytes of tensor {tensor!r}" if tensor else f"record {bad!r}"
    raise _error(f"{path}: checksum mismatch: {what} changed after the file was written (CRC-32 of record {bad!r} "
                 f"is {now:08x}, the archive recorded {info.CRC:08x}): disk or copy corruption. "
                 f"The file is refused rather than trained from; expected {expected}. Fix: use another checkpoint or "
                 "copy it again.")


def _file_crc(file: Path) -> int:
    crc = 0
    with open(file, "rb") as fh:
        while chunk := fh.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(folder: str | Path) -> Path:
    """Write ``checksums.json`` into ``folder``: the CRC-32 and size of every file in it (sub-folders included)."""
    import json

    root = Path(folder)
    entries = {str(f.relative_to(root)): {"crc32": f"{_file_crc(f):08x}", "bytes": f.stat().st_size}
               for f in sorted(root.rglob("*")) if f.is_file() and f.name != MANIFEST_FILE}
    out = root / MANIFEST_FILE
    out.write_text(json.dumps(entries, indent=1, sort_keys=True))
    return out


UNVERIFIED_ENV = "LIGHTNING_PARALLEL_ALLOW_UNVERIFIED"
"""Set to ``1`` to load a DCP checkpoint folder that has no ``checksums.json`` (written before the list existed, or
with the list lost), unverified. Unset, such a folder is refused: its ``.distcp`` shards carry no checksums, so without
the list nothing would be checked."""


def _is_dcp_like(root: Path) -> bool:
    return (root / DCP_METADATA_FILE).is_file() or (root / LAYOUT_FILE).is_file() or any(root.glob("*.distcp"))


def require_manifest(folder: str | Path) -> None:
    """Refuse (:class:`~lightning_parallel.checkpoint.errors.CheckpointFormatError`) a DCP folder without its
    ``checksums.json`` unless :data:`UNVERIFIED_ENV` is ``1``: the absence of the list is never read as "nothing to
    check". Cheap (no file is read); :func:`verify_folder` calls it first."""
    import os

    root = Path(folder)
    if not root.is_dir() or (root / MANIFEST_FILE).is_file() or not _is_dcp_like(root):
        return
    if os.environ.get(UNVERIFIED_ENV, "") == "1":
        return
    raise _error(
        f"{root}: a DCP checkpoint folder without {MANIFEST_FILE}. The library writes that list (CRC-32 and size of "
        "every file) last into every folder it saves; DCP's .distcp shards carry no checksums of their own, so "
        "without it a changed or truncated shard would load unnoticed. Fix: copy the folder again with its "
        f"{MANIFEST_FILE}, or -- for a folder written before the list existed, which you trust -- set "
        f"{UNVERIFIED_ENV}=1 to load it unverified."
    )


def verify_folder(folder: str | Path) -> None:
    """Check every file of a checkpoint folder against its ``checksums.json`` (a missing, resized, changed or
    unlisted file is refused). Without the list: a DCP folder is refused (:func:`require_manifest`); an lp_sharded or
    DeepSpeed folder written before the list existed has each of its ``.pt`` torch archives checked against the
    CRC-32 of their records instead. Raises :class:`~lightning_parallel.checkpoint.errors.CheckpointFormatError`
    naming the file."""
    import json
    import os

    root = Path(folder)
    manifest = root / MANIFEST_FILE
    require_manifest(root)
    if not manifest.is_file():  # lp_sharded and DeepSpeed folders: their .pt files are torch archives with CRCs
        if _is_dcp_like(root) and os.environ.get(UNVERIFIED_ENV, "") == "1":
            print(f"lightning-parallel: {root} has no {MANIFEST_FILE}; loading its DCP shards unverified "
                  f"({UNVERIFIED_ENV}=1)", flush=True)
        for file in sorted(root.rglob("*.pt")):
            verify_torch_file(file)
        return
    try:
        entries = json.loads(manifest.read_text())
    except (OSError, ValueError) as err:
        raise _error(f"{manifest}: unreadable checksum list ({err}); the folder cannot be verified.") from err
    if not isinstance(entries, dict) or not all(isinstance(e, dict) and {"crc32", "bytes"} <= set(e)
                                                for e in entries.values()):
        raise _error(f"{manifest}: not a checksum list (file -> crc32, bytes); the folder cannot be verified. Fix: "
                     "copy the folder again, or use another checkpoint.")
    unlisted = sorted(str(f.relative_to(root)) for f in root.rglob("*")
                      if f.is_file() and f.name != MANIFEST_FILE and str(f.relative_to(root)) not in entries)
    if unlisted:
        raise _error(f"{root}: {unlisted[:4]}{' ...' if len(unlisted) > 4 else ''} not listed in {MANIFEST_FILE}: "
                     "files of another save mixed in, or the list was replaced. Fix: copy the folder again, or use "
                     "another checkpoint.")
    for name, entry in sorted(entries.items()):
        file = root / name
        if not file.is_file():
            raise _error(f"{root}: {name} is missing (listed in {MANIFEST_FILE}): an incomplete copy of the folder. "
                         "Fix: copy the whole folder again, or use another checkpoint.")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise _error(f"{file}: {size:,} bytes, but {entry['bytes']:,} were written: truncated or replaced. Fix: "
                         "copy the folder again, or use another checkpoint.")
        crc = f"{_file_crc(file):08x}"
        if crc != entry["crc32"]:
            raise _error(f"{file}: checksum mismatch (CRC-32 {crc}, written as {entry['crc32']}): its bytes changed "
                         "after the save (disk or copy corruption). The folder is refused rather than trained from. "
                         "Fix: use another checkpoint or copy it again.")


class _Ranks(Protocol):
    @property
    def is_global_zero(self) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


_VERIFIED: set[tuple[str, int]] = set()


def verify_folder_on_rank_zero(strategy: _Ranks, path: str | Path) -> None:
    """:func:`verify_folder` on rank 0 for a checkpoint folder (a file is left to its reader); every rank raises
    the same :class:`~lightning_parallel.checkpoint.errors.CheckpointFormatError` on a mismatch (a collective). A
    folder this process verified already (the same path, unchanged) is not read again: every rank calls this in the
    same order, so every rank skips it alike."""
    if not Path(path).is_dir():
        return
    key = (str(Path(path).resolve()), Path(path).stat().st_mtime_ns)
    if key in _VERIFIED:
        return
    problem = ""
    if strategy.is_global_zero:
        try:
            verify_folder(path)
        except CheckpointFormatError as err:
            problem = str(err)
    problem = strategy.broadcast(problem)
    if problem:
        raise CheckpointFormatError(problem)
    _VERIFIED.add(key)
