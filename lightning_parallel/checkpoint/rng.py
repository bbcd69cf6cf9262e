"""Random-number-generator states in checkpoints: every rank's, saved together, restored rank by rank.

Lightning does not save RNG states, so dropout masks (and any randomness in a training step) after a resume differ
from the uninterrupted run. The library's strategies gather each rank's states (torch CPU, the accelerator's, numpy,
Python's ``random``; Lightning's ``_collect_rng_states``) into the checkpoint under :data:`RNG_KEY` when saving -- one
``all_gather_object``, every rank calls it -- and each rank restores its own when resuming on the same number of
ranks. Under another world size the ranks' streams cannot correspond (another layout splits the randomness
differently), so the states are left as seeded and rank 0 says so once.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .names import RNG_KEY

__all__ = ["RNG_KEY", "apply_restored_rng_states", "attach_rng_states", "restore_rng_states"]

_pending: list[dict[str, Any]] = []


def attach_rng_states(checkpoint: dict[str, Any]) -> None:
    """Add every rank's RNG states to ``checkpoint`` (a collective when a process group is up: call on all ranks)."""
    mine = _plain(_collect())
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        checkpoint[RNG_KEY] = gathered
    else:
        checkpoint[RNG_KEY] = [mine]


def restore_rng_states(checkpoint: dict[str, Any], *, rank: int, world_size: int, module: Any = None) -> bool:
    """Keep this rank's saved RNG states, when the checkpoint was written by as many ranks, for
    :func:`apply_restored_rng_states` (True if kept).

    They are applied when training starts (the strategies' ``on_train_start``), not when the checkpoint is read:
    between the two Lightning builds the training DataLoader's iterator, which draws its base seed from the global
    torch generator -- a draw the uninterrupted run made at the start of the epoch, not at the resumed step.
    ``module``: the LightningModule; nothing is kept unless its trainer is fitting (validate/test/predict never
    reach ``on_train_start``)."""
    _pending.clear()
    trainer = getattr(module, "_trainer", None)
    if trainer is not None and getattr(trainer.state, "fn", None) != "fit":
        return False
    states = checkpoint.get(RNG_KEY)
    if not isinstance(states, list) or len(states) != world_size:
        if states is not None and rank == 0:
            print(f"lightning-parallel: the checkpoint's RNG states are from {len(states)} rank(s), this run has "
                  f"{world_size}: random streams (dropout) continue from the seed, not from the checkpoint.",
                  flush=True)
        return False
    _pending[:] = [_numpy_back(states[rank])]
    return True


def apply_restored_rng_states() -> None:
    """Set the RNG states kept by :func:`restore_rng_states`, once (the strategies call it in ``on_train_start``)."""
    from lightning.fabric.utilities.seed import _set_rng_states

    if _pending:
        _set_rng_states(_pending.pop())


def _collect() -> dict[str, Any]:
    from lightning.fabric.utilities.seed import _collect_rng_states

    return _collect_rng_states(include_cuda=True)


def _plain(states: dict[str, Any]) -> dict[str, Any]:
    """numpy's state holds an ndarray, which ``torch.load(weights_only=True)`` refuses: keep it as a tensor."""
    import torch

    out = dict(states)
    np_state = out.get("numpy")
    if isinstance(np_state, tuple) and len(np_state) == 5:
        name, keys, pos, has_gauss, cached = np_state
        out["numpy"] = [str(name), torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return out


def _numpy_back(states: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    out = dict(states)
    np_state = out.get("numpy")
    if isinstance(np_state, list) and len(np_state) == 5:
        name, keys, pos, has_gauss, cached = np_state
        out["numpy"] = (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    return out
