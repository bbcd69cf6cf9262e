"""The checkpoint formats, one module each -- how each is written (a collective, by the strategy that uses it), read
back on the layout that wrote it, and read offline in one CPU process -- and :func:`detect_format`, which tells them
apart from the files alone (no process group, no Lightning import).

* :mod:`.lightning_file` -- ``lightning``: one file (``lp_ddp``, ``lp_dp``, ``lp_sharded`` ``checkpoint="full"``);
* :mod:`.sharded` -- ``lp_sharded``: ``meta.pt`` + one ``rank_XXXXX.pt`` per rank (``checkpoint="sharded"``);
* :mod:`.dcp` -- ``lp_tensor``, ``lp_pipeline``, ``lp_hybrid``: a torch DCP folder, one shard file per rank;
* :mod:`.deepspeed` -- ``deepspeed``, ``deepspeed_nvme``: DeepSpeed's ZeRO folder (``lp_zero_offload``).

:func:`detect_format` looks at the path and reads only the small files it needs (a one-file checkpoint is read
whole, with ``weights_only=True``); it refuses anything else with :class:`CheckpointFormatError`, naming the file and
what was expected. Every on-disk name is in :mod:`lightning_parallel.checkpoint.names`. See
:mod:`lightning_parallel.checkpoint` for the formats.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointFormatError
from ..names import META_FILE
from . import dcp, deepspeed, lightning_file, sharded
from .common import CheckpointFormat, CheckpointInfo, expected_any, load_torch_file

__all__ = [
    "CheckpointFormat",
    "CheckpointFormatError",
    "CheckpointInfo",
    "detect_format",
    "load_torch_file",
]

def detect_format(path: str | Path, *, trusted: bool = False) -> CheckpointInfo:
    """Tell the format of the checkpoint at ``path`` from its files (see :data:`CheckpointFormat`).

    Raises :class:`CheckpointFormatError` for a missing path, an unknown or foreign file or folder, or one that is
    incomplete (a rank file missing) or unreadable. ``trusted`` loads a one-file checkpoint or an lp_sharded folder's
    files with ``weights_only=False`` (only for files you trust).
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointFormatError(f"{p}: no such file or folder; expected {expected_any()}.")
    if p.is_file():
        return lightning_file.detect(p, trusted=trusted)
    if p.is_dir():
        # meta.pt + DCP's .metadata first (lp_tensor/lp_pipeline/lp_hybrid), then meta.pt alone, then DeepSpeed's
        for detect in (dcp.detect, sharded.detect, deepspeed.detect):
            info = detect(p, trusted=trusted)
            if info is not None:
                return info
        listing = sorted(x.name for x in p.iterdir())[:8]
        raise CheckpointFormatError(f"{p}: a folder with neither {META_FILE} nor a DeepSpeed checkpoint "
                                    f"(it holds {listing or 'nothing'}); expected {expected_any()}.")
    raise CheckpointFormatError(f"{p}: neither a file nor a folder; expected {expected_any()}.")
