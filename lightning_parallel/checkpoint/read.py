"""Readers: the full single-device state dict and the one-file Lightning checkpoint of any supported format.

No process group, one CPU process: the format is detected (:func:`~lightning_parallel.checkpoint.formats.
detect_format`) and its module's offline reader joins the weights (:mod:`lightning_parallel.checkpoint.formats`).
Lightning files and ``lp_sharded`` folders are read with ``weights_only=True``; DeepSpeed folders cannot be (see
:mod:`lightning_parallel.checkpoint`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.model_helpers import _restricted_classmethod
from torch import Tensor

from .errors import CheckpointFormatError
from .formats import CheckpointInfo, dcp, deepspeed, detect_format, lightning_file, sharded
from .formats.common import strip_wrapper_prefixes
from .formats.sharded import join_recorded_shards, join_zero3_shards

__all__ = ["DROPPED_KEYS", "LoadsAnyFormat", "full_checkpoint", "full_state_dict", "join_recorded_shards",
           "join_zero3_shards", "read_checkpoint", "strip_wrapper_prefixes"]

DROPPED_KEYS = ("optimizer_states", "lr_schedulers")
"""Top-level keys :func:`full_checkpoint` leaves out: the result is a weights-only checkpoint (optimizer and LR
scheduler states are per layout; Lightning's ``save_weights_only`` drops the same two)."""


class LoadsAnyFormat:
    """Mix into a LightningModule (before ``LightningModule``) so that ``Module.load_from_checkpoint(path)`` reads any
    of the library's formats: a checkpoint folder (sharded ZeRO, DCP, DeepSpeed) is joined into the one-device
    checkpoint in memory first (:func:`full_checkpoint`, what ``lightning-parallel consolidate`` writes), where
    Lightning's own failed on "Is a directory"; a file loads as Lightning loads it. The library's ``GPT`` and
    ``HFCausalLM`` have it."""

    @_restricted_classmethod  # as Lightning's: called on an instance it would return a new module, unnoticed
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(checkpoint_path, (str, Path)) and Path(checkpoint_path).is_dir():
            import io

            import torch

            buffer = io.BytesIO()
            # weights_only=False (Lightning's keyword) trusts the folder's files as it trusts a file
            torch.save(full_checkpoint(checkpoint_path, trusted=kwargs.get("weights_only") is False), buffer)
            buffer.seek(0)
            checkpoint_path = buffer
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]


def full_state_dict(path: str | Path, *, trusted: bool = False) -> dict[str, Tensor]:
    """The module's full single-device state dict from a checkpoint written under any of the library's strategies.

    Keys are the LightningModule's own parameter and buffer names (no wrapper prefixes); values are CPU tensors in
    the dtype they were trained in (DeepSpeed folders: the fp32 master weights). No process group is needed.
    ``trusted`` loads a one-file checkpoint or an lp_sharded folder with ``weights_only=False`` (runs code stored in
    the files: only for files you trust). Raises :class:`~lightning_parallel.checkpoint.CheckpointFormatError` for
    anything it cannot read.
    """
    return read_checkpoint(path, trusted=trusted)[0]


def full_checkpoint(path: str | Path, *, trusted: bool = False) -> dict[str, Any]:
    """The one-file, single-device Lightning checkpoint of ``path``: ``state_dict`` from :func:`full_state_dict`
    plus the source's other top-level Lightning keys (``hyper_parameters``, ``epoch``, ``global_step``, ``loops``,
    ``callbacks``, ...), without :data:`DROPPED_KEYS` (optimizer and LR-scheduler states are dropped)."""
    state, rest, _ = read_checkpoint(path, trusted=trusted)
    out = {k: v for k, v in rest.items() if k not in DROPPED_KEYS}
    out["state_dict"] = state
    return out


def read_checkpoint(path: str | Path, *, trusted: bool = False) -> tuple[dict[str, Tensor], dict[str, Any],
                                                                           CheckpointInfo]:
    """``(state_dict, other top-level Lightning keys, format info)`` of the checkpoint at ``path``."""
    try:
        info = detect_format(path, trusted=trusted)
    except OSError as err:  # e.g. a folder that cannot be listed
        raise CheckpointFormatError(f"{path}: cannot be read ({err.strerror or err}).") from err
    try:
        if info.format in lightning_file.FORMATS:
            state, rest = lightning_file.read_full(info)
        elif info.format in sharded.FORMATS:
            state, rest = sharded.read_full(info, trusted=trusted)
        elif info.format in dcp.FORMATS:
            state, rest = dcp.read_full(info)
        else:
            state, rest = deepspeed.read_full(info)
    except OSError as err:
        raise CheckpointFormatError(f"{err.filename or info.path}: cannot be read ({err.strerror or err}).") from err
    except (KeyError, TypeError, IndexError, AttributeError) as err:
        raise CheckpointFormatError(
            f"{info.path}: looks like a {info.describe()} but its content is not as expected "
            f"({type(err).__name__}: {err}); it may be corrupt or written by an incompatible version."
        ) from err
    return state, rest, info
