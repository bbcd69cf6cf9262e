"""What the format modules share: the format names, :class:`CheckpointInfo`, the verified ``torch.load``, the
removal of wrapper names, and what a strategy offers a format's writer and reader (:class:`CheckpointStrategy`)."""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import torch

from ..errors import CheckpointFormatError
from ..names import DEEPSPEED_LATEST_FILE, META_FILE
from ..verify import verify_torch_file

__all__ = [
    "CheckpointFormat",
    "CheckpointInfo",
    "CheckpointStrategy",
    "expected_any",
    "load_torch_file",
    "strip_wrapper_prefixes",
]

T = TypeVar("T")

CheckpointFormat = Literal["lightning", "lp_sharded", "lp_tensor", "lp_pipeline", "lp_hybrid", "deepspeed",
                           "deepspeed_nvme"]
"""``lightning``: one file (``lp_ddp``, ``lp_dp``, ``lp_sharded`` with ``checkpoint="full"``, any plain Lightning
strategy). ``lp_sharded``: a ``meta.pt`` + ``rank_XXXXX.pt`` folder (``checkpoint="sharded"``). ``deepspeed``: a
DeepSpeed ZeRO folder (``lp_zero_offload`` with CPU offload or none, Lightning's ``deepspeed``). ``deepspeed_nvme``:
the same written with NVMe offload, plus the per-rank ``lp_offload_state/`` files that hold its real weights.
``lp_tensor`` / ``lp_pipeline`` / ``lp_hybrid``: a torch DCP folder (``meta.pt``, ``layout.json``, ``.metadata``, one
``.distcp`` file per rank) holding tensor shards or pipeline stages under the whole model's names."""


class CheckpointStrategy(Protocol):
    """What a format's collective writer and its per-rank reader use of the strategy (any Lightning strategy)."""

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def lightning_module(self) -> Any: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def barrier(self, name: str | None = None) -> None: ...


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`~lightning_parallel.checkpoint.formats.detect_format` found.

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


def expected_any() -> str:
    """What a path given as a checkpoint should be, for the refusals."""
    return ("a checkpoint written by trainer.save_checkpoint: a Lightning file (a dict with 'state_dict'), an "
            f"lp_sharded folder ({META_FILE} + rank_XXXXX.pt) or a DeepSpeed folder ('{DEEPSPEED_LATEST_FILE}'"
            " + <tag>/*_model_states.pt + *_optim_states.pt)")


# Path components that only wrappers add (FSDP1, activation checkpointing, torch.compile): removed anywhere in a key.
_WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def strip_wrapper_prefixes(state: Mapping[str, T], *, leading: tuple[str, ...] = ()) -> dict[str, T]:
    """The state dict under the module's own names.

    Removes the path components only wrappers add, anywhere in a key (``_fsdp_wrapped_module``,
    ``_checkpoint_wrapped_module``, ``_orig_mod``), then each prefix of ``leading`` (e.g. ``"_forward_module."``,
    ``"module."``) while *every* key starts with it. ``leading`` is empty by default: a Lightning checkpoint's
    ``state_dict`` already has the LightningModule's names, and a module may own a child called ``module``.
    Raises ``ValueError`` if two keys would get the same name.
    """
    out: dict[str, T] = {}
    for key, value in state.items():
        name = ".".join(part for part in key.split(".") if part not in _WRAPPER_COMPONENTS)
        if name in out:
            raise ValueError(f"state dict keys collide once wrapper prefixes are removed: {name!r} (from {key!r}).")
        out[name] = value
    for prefix in leading:
        if out and all(k.startswith(prefix) and len(k) > len(prefix) for k in out):
            out = {k[len(prefix):]: v for k, v in out.items()}
    return out
