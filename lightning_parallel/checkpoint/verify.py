"""Verify a checkpoint file before it is loaded: empty, truncated, foreign, or changed since it was written.

``torch.save`` writes a zip archive (stored, not compressed) whose every record -- the pickle and one record per
tensor storage -- carries a CRC-32 checksum; ``torch.load`` does not check them, so a flipped byte inside a weight
loads and trains. :func:`verify_torch_file` reads the archive's records against their checksums (about 1 GB/s) and
refuses, naming the file and the record, and -- for a tensor's record -- the tensor (the state-dict key whose bytes
have the checksum the damaged record has now). It also tells an empty file, a truncated one (a zip archive whose
index, written last, is missing) and one that is not a torch archive at all apart, each with one message.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

__all__ = ["verify_torch_file"]

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header: 30 bytes


def _error(message: str) -> Exception:
    from lightning_parallel.checkpoint.formats import CheckpointFormatError

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
    """Raise :class:`~lightning_parallel.checkpoint.formats.CheckpointFormatError` for a file that is empty,
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
