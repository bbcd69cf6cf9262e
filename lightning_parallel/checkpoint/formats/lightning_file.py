"""The ``lightning`` format: one file, Lightning's checkpoint dict, ``state_dict`` holding the full weights under the
LightningModule's names (``lp_ddp``, ``lp_dp``, ``lp_sharded`` with ``checkpoint="full"``, any plain Lightning
strategy, and :func:`~lightning_parallel.checkpoint.consolidate`'s output).

* write: :func:`save` -- every rank's RNG states added (a collective), then rank 0 writes the dict with the
  strategy's ``CheckpointIO`` (Lightning's: a temporary file, then a move);
* read: the file is already the one-device form every strategy resumes from
  (:func:`~lightning_parallel.checkpoint.resume.resume_one_device`);
* offline read: :func:`detect` (loaded once, ``weights_only=True``) and :func:`read_full`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from .. import async_save, rng
from ..atomic import disk_errors
from ..errors import CheckpointFormatError
from ..names import META_FILE, SHARDED_KEY
from .common import (
    CheckpointInfo,
    CheckpointStrategy,
    agree_on_failure,
    check_format_version,
    expected_any,
    load_torch_file,
    refused_save,
    stamp_format_version,
    strip_wrapper_prefixes,
    tensor_bytes,
    wait_for_background_save,
)

__all__ = ["FORMATS", "detect", "read_full", "save"]

FORMATS = ("lightning",)


class _FileWritingStrategy(CheckpointStrategy, Protocol):
    @property
    def checkpoint_io(self) -> Any: ...


def save(strategy: _FileWritingStrategy, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
         ) -> None:
    """Write ``checkpoint`` as one file (collective: every rank calls it; rank 0 writes). A write the disk refuses
    (full, file too large) is a :class:`~lightning_parallel.checkpoint.errors.CheckpointWriteError` on every rank,
    naming the path and the bytes; nothing is written while the training state is refused
    (:func:`~.common.refused_save`). In the background (:mod:`~lightning_parallel.checkpoint.async_save`): rank 0
    copies it to host memory, a thread writes it (a failure there is raised by the next save, on every rank)."""
    if refused_save(strategy, filepath):
        return
    writer = wait_for_background_save(strategy)
    rng.attach_rng_states(checkpoint)
    stamp_format_version(checkpoint)
    if writer is not None:
        if strategy.is_global_zero:
            copy = async_save.host_copy(checkpoint)

            def write() -> None:
                with disk_errors(str(filepath), needed=tensor_bytes(copy)):
                    strategy.checkpoint_io.save_checkpoint(copy, filepath, storage_options=storage_options)

            writer.submit(str(filepath), write)
        return
    error: BaseException | None = None
    if strategy.is_global_zero:
        try:
            with disk_errors(str(filepath), needed=tensor_bytes(checkpoint)):
                strategy.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        except Exception as err:
            error = err
    agree_on_failure(strategy, error)


def detect(file: Path, *, trusted: bool) -> CheckpointInfo:
    """A one-file checkpoint, loaded (``weights_only`` unless ``trusted``); anything else is refused."""
    content = load_torch_file(file, trusted=trusted, what=expected_any())
    if not isinstance(content, dict) or not isinstance(content.get("state_dict"), dict):
        kind = type(content).__name__
        hint = ""
        if isinstance(content, dict) and content and all(isinstance(v, torch.Tensor) for v in content.values()):
            hint = " It looks like a bare state dict (torch.save(model.state_dict())): load it with load_state_dict."
        elif isinstance(content, dict) and SHARDED_KEY in content:
            hint = f" It is the {META_FILE} of an lp_sharded folder: pass the folder {file.parent}."
        raise CheckpointFormatError(f"{file}: a {kind} without a 'state_dict' dict; expected {expected_any()}.{hint}")
    check_format_version(content, where=file)
    bad = [k for k, v in content["state_dict"].items() if not isinstance(k, str)]
    if bad:
        raise CheckpointFormatError(f"{file}: its 'state_dict' has non-string keys {bad[:3]}; expected "
                                    f"{expected_any()}.")
    return CheckpointInfo(format="lightning", path=file, files=(file,), checkpoint=content)


def read_full(info: CheckpointInfo, *, trusted: bool = False) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``(state_dict under the module's names, every other top-level key)`` of a detected file."""
    content = info.checkpoint
    assert content is not None
    state = strip_wrapper_prefixes(content["state_dict"])
    return state, {k: v for k, v in content.items() if k != "state_dict"}
