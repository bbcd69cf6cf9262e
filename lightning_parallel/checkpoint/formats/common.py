"""What the format modules share: the format names, :class:`CheckpointInfo`, the verified ``torch.load``, the
removal of wrapper names, and what a strategy offers a format's writer and reader (:class:`CheckpointStrategy`)."""

from __future__ import annotations

import contextlib
import pickle
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import torch

from ..errors import CheckpointFormatError
from ..names import DEEPSPEED_LATEST_FILE, FORMAT_VERSION, FORMAT_VERSION_KEY, META_FILE
from ..verify import verify_torch_file

__all__ = [
    "CheckpointFormat",
    "CheckpointInfo",
    "CheckpointStrategy",
    "agree_on_failure",
    "check_format_version",
    "expected_any",
    "load_torch_file",
    "refused_save",
    "stamp_format_version",
    "strip_wrapper_prefixes",
    "tensor_bytes",
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


def _legacy_torch_file(file: Path) -> bool:
    """A pre-zip ``torch.save`` file (``_use_new_zipfile_serialization=False``): a pickle, which starts with the
    PROTO opcode (0x80) and a protocol number; read only when trusted."""
    with open(file, "rb") as fh:
        head = fh.read(2)
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5 and not zipfile.is_zipfile(file)


def load_torch_file(file: Path, *, trusted: bool = False, what: str = "a checkpoint file") -> Any:
    """``torch.load`` on CPU with ``weights_only=True`` (``trusted``: ``weights_only=False``, which runs code stored
    in the file); any failure becomes a :class:`CheckpointFormatError` naming the file and what was expected."""
    if not (trusted and _legacy_torch_file(file)):  # empty, truncated, foreign, or failing its records' checksums
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


def check_format_version(content: Any, *, where: str | Path, key: str = FORMAT_VERSION_KEY) -> int:
    """The checkpoint format version recorded in ``content`` (a checkpoint dict, or ``layout.json``'s mapping with
    ``key="format_version"``); 0 when absent (written before versions existed). A version this code cannot read --
    newer than :data:`~lightning_parallel.checkpoint.names.FORMAT_VERSION`, or not a non-negative integer -- is
    refused with both versions named."""
    version = content.get(key, 0) if isinstance(content, Mapping) else 0
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise CheckpointFormatError(
            f"{where}: checkpoint format version {version!r} is not a version this library writes (a non-negative "
            f"integer, at most {FORMAT_VERSION}); the file was changed or written by something else. Fix: use "
            "another checkpoint."
        )
    if version > FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{where}: written with checkpoint format version {version}; this lightning-parallel "
            f"({_library_version()}) reads versions 0 to {FORMAT_VERSION}. Fix: resume it with the lightning-parallel "
            "that wrote it (or a newer one), or consolidate it there into a one-file checkpoint "
            "(`lightning-parallel consolidate IN OUT`)."
        )
    return version


REFUSE_SAVES_ATTR = "_lp_refuse_saves"
"""Set on a strategy (to the reason) when the training state must not be saved any more: the loss became non-finite
(:class:`~lightning_parallel.callbacks.NonFiniteLossGuard`); every format's ``save`` then writes nothing."""


def refused_save(strategy: Any, filepath: Any) -> bool:
    """True (and a note on rank 0) when the strategy's state must not be saved (:data:`REFUSE_SAVES_ATTR`): the save
    of ``filepath`` is skipped on every rank, so a non-finite state never replaces a good checkpoint."""
    reason = getattr(strategy, REFUSE_SAVES_ATTR, None)
    if not reason:
        return False
    if getattr(strategy, "is_global_zero", True):
        print(f"lightning-parallel: not saving {filepath}: {reason}", flush=True)
    return True


def agree_on_failure(strategy: CheckpointStrategy, error: BaseException | None, *, cleanup: Path | None = None
                     ) -> None:
    """Collective, after one phase of a checkpoint write: every rank passes what its own part raised (or None); if
    any rank failed, rank 0 removes ``cleanup`` (the ``.partial`` folder) and every rank raises the first failure --
    so no rank goes on to the next collective of the save and waits there for one that gave up."""
    import torch.distributed as dist

    from ..atomic import remove_path
    from ..errors import CheckpointWriteError

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        text = None if error is None else (error.errno, str(error), getattr(error, "filename", None)) if isinstance(
            error, CheckpointWriteError) else f"{type(error).__name__}: {error}"
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, text)
        failed = [(rank, t) for rank, t in enumerate(gathered) if t is not None]
    else:
        failed = [] if error is None else [(0, None)]
    if not failed:
        return
    if cleanup is not None and strategy.is_global_zero:
        with contextlib.suppress(OSError):
            remove_path(cleanup)
    if error is not None:
        raise error
    rank, text = failed[0]
    if isinstance(text, tuple):
        raise CheckpointWriteError(text[0], f"rank {rank}: {text[1]}", text[2])
    raise CheckpointFormatError(f"the checkpoint save failed on rank {rank} ({text}); this rank stops with it.")


def wait_for_background_save(strategy: CheckpointStrategy) -> Any:
    """First in every format's save, on every rank (a collective): wait for this process's background save in flight
    (:func:`~lightning_parallel.checkpoint.async_save.before_save`); if it failed on any rank, every rank raises
    (:class:`~lightning_parallel.checkpoint.async_save.BackgroundSaveError` on the rank whose part failed). Returns
    the writer when this save is to run in the background, else None."""
    from .. import async_save

    error: BaseException | None = None
    writer = None
    try:
        writer = async_save.before_save()
    except async_save.BackgroundSaveError as err:
        error = err
    agree_on_failure(strategy, error)
    return writer


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in a nested checkpoint structure (what a save of it writes, give or take the pickle)."""
    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", value)  # a DTensor: this rank's shard
        return int(local.numel() * local.element_size())
    if isinstance(value, Mapping):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


def stamp_format_version(checkpoint: dict[str, Any]) -> None:
    """Record :data:`~lightning_parallel.checkpoint.names.FORMAT_VERSION` in a checkpoint dict about to be saved."""
    checkpoint[FORMAT_VERSION_KEY] = FORMAT_VERSION


def _library_version() -> str:
    try:
        from importlib.metadata import version

        return f"version {version('lightning-parallel')}"
    except Exception:
        return "this version"


def expected_any() -> str:
    """What a path given as a checkpoint should be, for the refusals."""
    return ("a checkpoint written by trainer.save_checkpoint: a Lightning file (a dict with 'state_dict'), an "
            f"lp_sharded folder ({META_FILE} + rank_XXXXX.pt), an lp_tensor/lp_pipeline/lp_hybrid folder ({META_FILE} "
            f"+ layout.json + a distributed checkpoint's .metadata and *.distcp) or a DeepSpeed folder "
            f"('{DEEPSPEED_LATEST_FILE}' + <tag>/*_model_states.pt + *_optim_states.pt)")


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
