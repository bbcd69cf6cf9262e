"""Which kind of checkpoint a path holds, told from its files alone (no process group, no Lightning import).

:func:`detect_format` looks at the path and reads only the small files it needs (a one-file checkpoint is read
whole, with ``weights_only=True``); it refuses anything else with :class:`CheckpointFormatError`, naming the file and
what was expected. See :mod:`lightning_parallel.checkpoint` for the formats.
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_parallel.config import UserInputError

__all__ = [
    "DEEPSPEED_LATEST_FILE",
    "NVME_STATE_DIR",
    "SHARDED_KEY",
    "SHARDED_META_FILE",
    "CheckpointFormat",
    "CheckpointFormatError",
    "CheckpointInfo",
    "detect_format",
    "load_torch_file",
]

CheckpointFormat = Literal["lightning", "lp_sharded", "lp_tensor", "lp_pipeline", "lp_hybrid", "deepspeed",
                           "deepspeed_nvme"]
"""``lightning``: one file (``lp_ddp``, ``lp_dp``, ``lp_sharded`` with ``checkpoint="full"``, any plain Lightning
strategy). ``lp_sharded``: a ``meta.pt`` + ``rank_XXXXX.pt`` folder (``checkpoint="sharded"``). ``deepspeed``: a
DeepSpeed ZeRO folder (``lp_zero_offload`` with CPU offload or none, Lightning's ``deepspeed``). ``deepspeed_nvme``:
the same written with NVMe offload, plus the per-rank ``lp_offload_state/`` files that hold its real weights.
``lp_tensor`` / ``lp_pipeline``: a torch DCP folder (``meta.pt``, ``layout.json``, ``.metadata``, one ``.distcp`` file
per rank) holding tensor shards or pipeline stages under the whole model's names."""

SHARDED_META_FILE = "meta.pt"
SHARDED_KEY = "lp_sharded_checkpoint"
DEEPSPEED_LATEST_FILE = "latest"
NVME_STATE_DIR = "lp_offload_state"
_RANK_FILE = "rank_{rank:05d}.pt"


class CheckpointFormatError(UserInputError):
    """The path is missing, is not a checkpoint of a known format, or is incomplete or corrupt."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`detect_format` found.

    Attributes:
        format: the format (:data:`CheckpointFormat`).
        path: the path given.
        files: the files that make up the checkpoint (for a DeepSpeed folder: its tag sub-folder's files, plus the
            NVMe state files when present).
        zero_stage: the ZeRO stage that wrote it, when the files say (sharded and DeepSpeed folders).
        world_size: the number of ranks that wrote it, when the files say.
        tag: a DeepSpeed folder's tag (its sub-folder, ``checkpoint`` when written by Lightning).
        checkpoint: a one-file checkpoint's loaded content (read once, reused by the readers).
    """

    format: CheckpointFormat
    path: Path
    files: tuple[Path, ...]
    zero_stage: int | None = None
    world_size: int | None = None
    tag: str | None = None
    checkpoint: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def describe(self) -> str:
        """A short human description, e.g. ``lp_sharded folder (ZeRO-3, 2 ranks)``."""
        details = []
        if self.zero_stage is not None:
            details.append(f"ZeRO-{self.zero_stage}")
        if self.format == "deepspeed_nvme":
            details.append("NVMe offload")
        if self.world_size is not None:
            details.append(f"{self.world_size} rank{'s' if self.world_size != 1 else ''}")
        name = {"lightning": "Lightning file", "lp_sharded": "lp_sharded folder", "lp_tensor": "lp_tensor folder (DCP)",
                "lp_pipeline": "lp_pipeline folder (DCP, one shard per stage)",
                "lp_hybrid": "lp_hybrid folder (DCP, one shard per rank)", "deepspeed": "DeepSpeed folder",
                "deepspeed_nvme": "DeepSpeed folder"}[self.format]
        return f"{name} ({', '.join(details)})" if details else name


def load_torch_file(file: Path, *, trusted: bool = False, what: str = "a checkpoint file") -> Any:
    """``torch.load`` on CPU with ``weights_only=True`` (``trusted``: ``weights_only=False``, which runs code stored
    in the file); any failure becomes a :class:`CheckpointFormatError` naming the file and what was expected."""
    from lightning_parallel.checkpoint.verify import verify_torch_file

    if not trusted or zipfile.is_zipfile(file):  # empty, truncated, foreign, or failing its records' checksums
        verify_torch_file(file, expected=what)
    try:
        return torch.load(file, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "weights_only" in str(err) or "Unsupported global" in str(err):
            raise CheckpointFormatError(
                f"{file}: torch.load(weights_only=True) refuses its content ({first}). It holds pickled objects "
                "besides tensors and plain containers. If you trust the file, load it with trusted=True "
                "(lightning-parallel consolidate --trust), which uses weights_only=False and runs code stored in it."
            ) from err
        raise CheckpointFormatError(f"{file}: not a readable torch file ({first}); expected {what}.") from err
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError, AttributeError, ImportError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointFormatError(f"{file}: not a readable torch file ({type(err).__name__}: {first}); "
                                    f"expected {what}.") from err


def _expected() -> str:
    return ("a checkpoint written by trainer.save_checkpoint: a Lightning file (a dict with 'state_dict'), an "
            f"lp_sharded folder ({SHARDED_META_FILE} + rank_XXXXX.pt) or a DeepSpeed folder ('{DEEPSPEED_LATEST_FILE}'"
            " + <tag>/*_model_states.pt + *_optim_states.pt)")


def detect_format(path: str | Path, *, trusted: bool = False) -> CheckpointInfo:
    """Tell the format of the checkpoint at ``path`` from its files (see :data:`CheckpointFormat`).

    Raises :class:`CheckpointFormatError` for a missing path, an unknown or foreign file or folder, or one that is
    incomplete (a rank file missing) or unreadable. ``trusted`` loads a one-file checkpoint or an lp_sharded folder's
    files with ``weights_only=False`` (only for files you trust).
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointFormatError(f"{p}: no such file or folder; expected {_expected()}.")
    if p.is_file():
        return _detect_file(p, trusted=trusted)
    if p.is_dir():
        from lightning_parallel.parallel.tensor.checkpoint import is_tensor_checkpoint, saved_strategy

        if is_tensor_checkpoint(p):  # meta.pt + DCP's .metadata: lp_tensor's or lp_pipeline's per-rank shards
            wrote = saved_strategy(p)
            fmt: CheckpointFormat = "lp_pipeline" if wrote == "lp_pipeline" else (
                "lp_hybrid" if wrote == "lp_hybrid" else "lp_tensor")
            return CheckpointInfo(format=fmt, path=p, files=tuple(sorted(p.iterdir())))
        if (p / SHARDED_META_FILE).is_file():
            return _detect_sharded(p, trusted=trusted)
        if (p / DEEPSPEED_LATEST_FILE).is_file() or any(p.glob("*/*_model_states.pt")):
            return _detect_deepspeed(p)
        listing = sorted(x.name for x in p.iterdir())[:8]
        raise CheckpointFormatError(f"{p}: a folder with neither {SHARDED_META_FILE} nor a DeepSpeed checkpoint "
                                    f"(it holds {listing or 'nothing'}); expected {_expected()}.")
    raise CheckpointFormatError(f"{p}: neither a file nor a folder; expected {_expected()}.")


def _detect_file(file: Path, *, trusted: bool) -> CheckpointInfo:
    content = load_torch_file(file, trusted=trusted, what=_expected())
    if not isinstance(content, dict) or not isinstance(content.get("state_dict"), dict):
        kind = type(content).__name__
        hint = ""
        if isinstance(content, dict) and content and all(isinstance(v, torch.Tensor) for v in content.values()):
            hint = " It looks like a bare state dict (torch.save(model.state_dict())): load it with load_state_dict."
        elif isinstance(content, dict) and SHARDED_KEY in content:
            hint = f" It is the {SHARDED_META_FILE} of an lp_sharded folder: pass the folder {file.parent}."
        raise CheckpointFormatError(f"{file}: a {kind} without a 'state_dict' dict; expected {_expected()}.{hint}")
    bad = [k for k, v in content["state_dict"].items() if not isinstance(k, str)]
    if bad:
        raise CheckpointFormatError(f"{file}: its 'state_dict' has non-string keys {bad[:3]}; expected {_expected()}.")
    return CheckpointInfo(format="lightning", path=file, files=(file,), checkpoint=content)


def _detect_sharded(folder: Path, *, trusted: bool) -> CheckpointInfo:
    meta_file = folder / SHARDED_META_FILE
    meta = load_torch_file(meta_file, trusted=trusted,
                           what=f"the {SHARDED_META_FILE} of an lp_sharded checkpoint folder")
    info = meta.get(SHARDED_KEY) if isinstance(meta, dict) else None
    if not isinstance(info, dict) or not {"zero_stage", "world_size"} <= set(info):
        raise CheckpointFormatError(
            f"{meta_file}: no '{SHARDED_KEY}' entry with zero_stage and world_size; expected the {SHARDED_META_FILE} "
            "written by lp_sharded (checkpoint='sharded')."
        )
    stage, world = int(info["zero_stage"]), int(info["world_size"])
    ranks = [folder / _RANK_FILE.format(rank=r) for r in range(world)]
    missing = [f.name for f in ranks if not f.is_file()]
    if missing:
        raise CheckpointFormatError(
            f"{folder}: {SHARDED_META_FILE} says {world} ranks wrote this ZeRO-{stage} checkpoint, but "
            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} is missing (an interrupted save or a "
            "partial copy); expected one rank_XXXXX.pt per rank."
        )
    extra = sorted(x.name for x in folder.glob("rank_*.pt") if x not in ranks)
    if extra:
        raise CheckpointFormatError(f"{folder}: {SHARDED_META_FILE} says {world} ranks, but the folder also holds "
                                    f"{extra[:4]} (files of another save mixed in); expected exactly {world} rank "
                                    "files.")
    return CheckpointInfo(format="lp_sharded", path=folder, files=(meta_file, *ranks), zero_stage=stage,
                          world_size=world, checkpoint=meta)


def _deepspeed_tag(folder: Path) -> str:
    latest = folder / DEEPSPEED_LATEST_FILE
    if latest.is_file():
        tag = latest.read_text().strip()
        if not (folder / tag).is_dir():
            raise CheckpointFormatError(f"{latest} names the tag {tag!r}, but {folder / tag} is not a folder; expected "
                                        "a DeepSpeed checkpoint folder with that tag's sub-folder.")
        return tag
    tags = sorted({f.parent.name for f in folder.glob("*/*_model_states.pt")})
    if len(tags) != 1:
        raise CheckpointFormatError(f"{folder}: no '{DEEPSPEED_LATEST_FILE}' file and {len(tags)} tag sub-folders "
                                    f"({tags[:4]}); expected a DeepSpeed folder naming its tag in "
                                    f"'{DEEPSPEED_LATEST_FILE}'.")
    return tags[0]


def _detect_deepspeed(folder: Path) -> CheckpointInfo:
    tag = _deepspeed_tag(folder)
    sub = folder / tag
    model_files = sorted(sub.glob("*_model_states.pt"))
    optim_files = sorted(sub.glob("*_optim_states.pt"))
    if not model_files or not optim_files:
        raise CheckpointFormatError(
            f"{sub}: {len(model_files)} *_model_states.pt and {len(optim_files)} *_optim_states.pt files; expected a "
            "DeepSpeed ZeRO checkpoint (model states and one optimizer-state partition per rank)."
        )
    first = next((f for f in model_files if f.name in ("mp_rank_00_model_states.pt",
                                                        "zero_pp_rank_0_mp_rank_00_model_states.pt")), model_files[0])
    states = _load_model_states(first)
    zero = (states.get("ds_config") or {}).get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    world = int(states.get("dp_world_size") or len(optim_files))
    if stage < 1 or len(optim_files) != world:
        raise CheckpointFormatError(
            f"{sub}: ZeRO stage {stage} written by {world} data-parallel ranks, but {len(optim_files)} "
            "*_optim_states.pt files; expected a ZeRO (stage 1-3) checkpoint with one optimizer-state file per rank."
        )
    nvme = any((zero.get(k) or {}).get("device") == "nvme" for k in ("offload_param", "offload_optimizer"))
    nvme_dir = folder / NVME_STATE_DIR
    nvme_files = tuple(sorted(nvme_dir.glob("lp_offload_rank*.pt"))) if nvme_dir.is_dir() else ()
    if nvme and len(nvme_files) != world:
        raise CheckpointFormatError(
            f"{folder}: written with NVMe offload, but {nvme_dir} holds {len(nvme_files)} lp_offload_rank*.pt files "
            f"for {world} ranks. DeepSpeed does not save or restore NVMe-offloaded state reliably, so its own "
            "partitions are not read for it; expected one NVMe state file per rank, as lp_zero_offload writes them."
        )
    fmt: CheckpointFormat = "deepspeed_nvme" if nvme else "deepspeed"
    return CheckpointInfo(format=fmt, path=folder, files=(*model_files, *optim_files, *nvme_files), zero_stage=stage,
                          world_size=world, tag=tag, checkpoint=states)


def _load_model_states(file: Path) -> dict[str, Any]:
    """A DeepSpeed model-states file: ``weights_only=True`` where its content allows (DeepSpeed 0.19 writes plain
    containers, tensors and ``torch.Size``), else ``weights_only=False`` -- the folder's optimizer-state files are
    read that way by DeepSpeed's ``zero_to_fp32`` in any case (they hold DeepSpeed objects)."""
    try:
        states = load_torch_file(file, what="a DeepSpeed model-states file")
    except CheckpointFormatError:
        states = load_torch_file(file, trusted=True, what="a DeepSpeed model-states file")
    if not isinstance(states, dict) or "module" not in states or "ds_config" not in states:
        raise CheckpointFormatError(f"{file}: no 'module' and 'ds_config' entries; expected a DeepSpeed model-states "
                                    "file.")
    return states
