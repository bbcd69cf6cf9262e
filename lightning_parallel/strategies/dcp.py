"""``DCPCheckpointMixin``: checkpoints as torch DCP folders, one shard per rank, for strategies whose ranks hold
different parts of the model (tensor shards, pipeline stages).

``trainer.save_checkpoint(path)`` writes a folder (:mod:`lightning_parallel.checkpoint.formats.dcp`): the module's
``state_dict()`` as each rank holds it (DTensor shards, or only a pipeline stage's layers -- under the whole model's
names), each optimizer's state by parameter name, ``meta.pt`` (everything else of the Lightning checkpoint, from rank
0) and ``layout.json`` (the layout that wrote it, readable without unpickling). A strategy names its layout
(:meth:`checkpoint_layout`) and says which saved layouts it reads shard by shard (:meth:`can_read_saved_layout`);
anything else -- a one-device file, another strategy's folder -- is read in the one-device form and each rank takes
the tensors it holds (:func:`~lightning_parallel.checkpoint.resume.place_model_state`,
:func:`~lightning_parallel.checkpoint.resume.place_optimizer_state`); tensors this rank does not hold (other pipeline
stages) are skipped.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer

from lightning_parallel.checkpoint.formats import dcp as dcp_format
from lightning_parallel.checkpoint.names import DCP_FOLDER_KEY, DCP_LAYOUT_KEYS
from lightning_parallel.config import LayoutError

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DCPCheckpointMixin"]


class DCPCheckpointMixin:
    """Save/resume through DCP folders; mix in before :class:`~lightning_parallel.strategies.base.LayoutStrategy`."""

    if TYPE_CHECKING:
        strategy_name: str
        optimizers: list[Optimizer]

        @property
        def lightning_module(self) -> pl.LightningModule | None: ...

        @property
        def is_global_zero(self) -> bool: ...

        @property
        def global_rank(self) -> int: ...

        @property
        def world_size(self) -> int: ...

        def broadcast(self, obj: Any, src: int = 0) -> Any: ...

        def barrier(self, name: str | None = None) -> None: ...

        def describe(self) -> str: ...

    @property
    def checkpoint_key(self) -> str:
        """The ``meta.pt`` key that records the layout: :data:`~lightning_parallel.checkpoint.names.DCP_LAYOUT_KEYS`
        of this strategy (``lp_tensor``'s for a strategy of another name)."""
        return DCP_LAYOUT_KEYS.get(self.strategy_name, DCP_LAYOUT_KEYS["lp_tensor"])

    def checkpoint_layout(self) -> dict[str, Any]:
        """What ``meta.pt`` and ``layout.json`` record about the layout (subclasses)."""
        return {}

    def can_read_saved_layout(self, saved: dict[str, Any]) -> bool:
        """Whether each rank can read its own tensors of a folder with this saved layout straight from the DCP files
        (True) or the folder is joined into the one-device form first (False)."""
        return True

    def merge_saved_param_groups(self, gathered: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """One optimizer's ``param_groups`` (parameter names) from every rank, joined into the whole model's: each
        group's names in rank order, each once (ranks that hold other parameters add theirs)."""
        merged: list[dict[str, Any]] = []
        for i, group in enumerate(gathered[0]):
            names: list[str] = []
            for rank_groups in gathered:
                names.extend(n for n in rank_groups[i]["params"] if n not in names)
            merged.append({**group, "params": names})
        return merged

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the parallelized module and the wrapped optimizers

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict as it is on this rank (saved by DCP, rank by rank)."""
        assert self.lightning_module is not None
        return dict(self.lightning_module.state_dict())

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state by parameter name, laid out like the parameters (ZeRO-1: gathered over ``dp``, a
        collective every rank runs)."""
        from lightning_parallel.parallel.tensor.state import optimizer_state_by_name
        from lightning_parallel.parallel.tensor.sync import LocalShardZeroOptimizer

        raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        assert self.lightning_module is not None
        if isinstance(raw, LocalShardZeroOptimizer):
            return raw.state_by_name(self.lightning_module)
        return optimizer_state_by_name(self.lightning_module, raw)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """A folder: DCP shards of the module and optimizer states from every rank, ``meta.pt`` and ``layout.json``
        from rank 0. Written next to the target and renamed into place, so a failed save never leaves a half folder
        under the checkpoint's name (:func:`lightning_parallel.checkpoint.formats.dcp.save`)."""
        dcp_format.save(self, checkpoint, filepath, layout_key=self.checkpoint_key,
                        layout={"strategy": self.strategy_name, **self.checkpoint_layout()},
                        merge_param_groups=self.merge_saved_param_groups)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero and Path(filepath).is_dir():
            shutil.rmtree(filepath)
        elif self.is_global_zero and Path(filepath).is_file():
            Path(filepath).unlink()

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """A DCP folder of this strategy whose layout :meth:`can_read_saved_layout` accepts: each rank reads its own
        shards from the files (in :meth:`load_model_state_dict` / :meth:`load_optimizer_state_dict`). Anything else
        -- a one-device file, another strategy's folder, a folder of another tensor-parallel size -- is joined into
        the one-device form (:func:`~lightning_parallel.checkpoint.resume.read_resumable`) and each rank takes the
        tensors it holds, cut like its parameters. A folder is first checked against its checksums (rank 0; every
        rank stops on a mismatch)."""
        from lightning_parallel.checkpoint.resume import resume_one_device
        from lightning_parallel.checkpoint.verify import verify_folder_on_rank_zero

        path = Path(self.broadcast(str(checkpoint_path)))
        verify_folder_on_rank_zero(self, path)
        checkpoint = dcp_format.load(self, path, layout_key=self.checkpoint_key,
                                     can_read_saved_layout=self.can_read_saved_layout)
        if checkpoint is None:  # this rank's tensors; the optimizer is matched by name later
            return resume_one_device(self, path, whole_module=False)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        from lightning_parallel.checkpoint.resume import place_model_state

        module = self.lightning_module
        assert module is not None
        folder = checkpoint.get(DCP_FOLDER_KEY)
        if folder is not None:
            dcp_format.refuse_written_weights(checkpoint.get("state_dict"), str(folder))
            dcp_format.load_model(folder, module)
        else:  # a one-device file: place each whole tensor as this rank holds it
            place_model_state(module, checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        from lightning_parallel.checkpoint.resume import place_optimizer_state
        from lightning_parallel.parallel.tensor.state import apply_optimizer_state
        from lightning_parallel.parallel.tensor.sync import LocalShardZeroOptimizer

        module = self.lightning_module
        assert module is not None
        folder = checkpoint.get(DCP_FOLDER_KEY)
        saved_states = checkpoint.get("optimizer_states", [])
        if folder is None and len(saved_states) != len(self.optimizers):
            raise LayoutError(f"the checkpoint holds {len(saved_states)} optimizer state(s), this run has "
                              f"{len(self.optimizers)} optimizer(s). Fix: resume with the same configure_optimizers.")
        for i, optimizer in enumerate(self.optimizers):
            raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            if folder is not None:
                by_name = dcp_format.load_optimizer(folder, i, module)
            else:
                by_name = place_optimizer_state(module, raw, saved_states[i], self.merge_saved_param_groups)
            if isinstance(raw, LocalShardZeroOptimizer):
                raw.load_state_by_name(module, by_name)
            else:
                apply_optimizer_state(module, raw, by_name)
