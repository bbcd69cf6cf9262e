"""``DCPCheckpointMixin``: checkpoints as torch DCP folders, one shard per rank, for strategies whose ranks hold
different parts of the model (tensor shards, pipeline stages).

``trainer.save_checkpoint(path)`` writes a folder (:mod:`lightning_parallel.parallel.tensor.checkpoint`): the module's
``state_dict()`` as each rank holds it (DTensor shards, or only a pipeline stage's layers -- under the whole model's
names), each optimizer's state by parameter name, ``meta.pt`` (everything else of the Lightning checkpoint, from rank
0) and ``layout.json`` (the layout that wrote it, readable without unpickling). A strategy names its layout record
(:attr:`checkpoint_key`, :meth:`checkpoint_layout`) and says which saved layouts it resumes
(:meth:`check_saved_layout`). A one-device Lightning file also loads: each whole tensor is scattered as this rank
holds it; tensors this rank does not hold (other pipeline stages) are skipped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer

from lightning_parallel.config import LayoutError

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DCPCheckpointMixin"]

FOLDER_KEY = "_lp_dcp_folder"


class DCPCheckpointMixin:
    """Save/resume through DCP folders; mix in before :class:`~lightning_parallel.strategies.base.LayoutStrategy`."""

    checkpoint_key = "lp_tensor_checkpoint"
    """The ``meta.pt`` key (and ``layout.json``'s ``strategy``) that records the layout."""

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
        from lightning_parallel.parallel.tensor.checkpoint import optimizer_state_by_name
        from lightning_parallel.parallel.tensor.sync import LocalShardZeroOptimizer

        raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        assert self.lightning_module is not None
        if isinstance(raw, LocalShardZeroOptimizer):
            return raw.state_by_name(self.lightning_module)
        return optimizer_state_by_name(self.lightning_module, raw)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """A folder: DCP shards of the module and optimizer states from every rank, ``meta.pt`` and ``layout.json``
        from rank 0. Written next to the target and renamed into place, so a failed save never leaves a half folder
        under the checkpoint's name."""
        from lightning_parallel.checkpoint.atomic import fresh_partial, partial_path, replace_with
        from lightning_parallel.parallel.tensor.checkpoint import LAYOUT_FILE, save_sharded

        path = Path(self.broadcast(str(filepath)))
        partial = partial_path(path)
        if self.is_global_zero:
            fresh_partial(path)
        self.barrier("lp_dcp_mkdir")
        from lightning_parallel.checkpoint.rng import attach_rng_states

        attach_rng_states(checkpoint)  # every rank's, into meta.pt (a collective)
        model_state = checkpoint.pop("state_dict")
        optim_states = checkpoint.pop("optimizer_states", [])
        if dist.is_initialized() and dist.get_world_size() > 1 and optim_states:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, [s["param_groups"] for s in optim_states])
            optim_states = [{**s, "param_groups": self.merge_saved_param_groups([g[i] for g in gathered])}
                            for i, s in enumerate(optim_states)]
        layout = {"strategy": self.strategy_name, **self.checkpoint_layout()}
        checkpoint[self.checkpoint_key] = layout
        save_sharded(partial, model_state=model_state, optimizer_states=optim_states,
                     meta=checkpoint if self.is_global_zero else None, rank=self.global_rank)
        self.barrier("lp_dcp_saved")
        if self.is_global_zero:
            from lightning_parallel.checkpoint.verify import write_manifest

            (partial / LAYOUT_FILE).write_text(json.dumps(layout, indent=1, sort_keys=True))
            write_manifest(partial)  # CRC-32 per file, checked before a load
            replace_with(partial, path)  # a checkpoint saved again under one name (last.ckpt): no stale shard files
        self.barrier("lp_dcp_renamed")

    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero and Path(filepath).is_dir():
            shutil.rmtree(filepath)
        elif self.is_global_zero and Path(filepath).is_file():
            Path(filepath).unlink()

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """A DCP folder of this strategy whose layout :meth:`check_saved_layout` accepts: each rank reads its own
        shards from the files (in :meth:`load_model_state_dict` / :meth:`load_optimizer_state_dict`). Anything else
        -- a one-device file, another strategy's folder, a folder of another tensor-parallel size -- is joined into
        the one-device form (:func:`~lightning_parallel.checkpoint.resume.read_resumable`) and each rank takes the
        tensors it holds, cut like its parameters."""
        from lightning_parallel.checkpoint.resume import check_fits, load_for_resume, resume_note
        from lightning_parallel.checkpoint.rng import restore_rng_states
        from lightning_parallel.parallel.tensor.checkpoint import META_FILE, is_tensor_checkpoint

        path = Path(self.broadcast(str(checkpoint_path)))
        checkpoint: dict[str, Any] | None = None
        if path.is_dir():  # rank 0 reads the files against their checksums; every rank stops on a mismatch
            from lightning_parallel.checkpoint.formats import CheckpointFormatError
            from lightning_parallel.checkpoint.verify import verify_folder

            problem = ""
            if self.is_global_zero:
                try:
                    verify_folder(path)
                except CheckpointFormatError as err:
                    problem = str(err)
            problem = self.broadcast(problem)
            if problem:
                raise CheckpointFormatError(problem)
        if is_tensor_checkpoint(path):
            checkpoint = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
            saved = next((checkpoint[k] for k in ("lp_tensor_checkpoint", "lp_pipeline_checkpoint",
                                                  "lp_hybrid_checkpoint") if k in checkpoint), None)
            if saved is None or checkpoint.get(self.checkpoint_key) is None or not self.can_read_saved_layout(saved):
                checkpoint = None
        if checkpoint is None:
            full = load_for_resume(path, strategy=self.strategy_name)
            if self.lightning_module is not None:  # this rank's tensors; the optimizer is matched by name later
                check_fits(full, module=self.lightning_module, optimizers=self.optimizers, path=path,
                           whole_module=False)
            note = resume_note(full, strategy=self.strategy_name, layout=self.describe())
            if note and self.is_global_zero:
                print(note, flush=True)
            restore_rng_states(full, rank=self.global_rank, world_size=self.world_size, module=self.lightning_module)
            return full
        restore_rng_states(checkpoint, rank=self.global_rank, world_size=self.world_size, module=self.lightning_module)
        checkpoint[FOLDER_KEY] = str(path)
        # the tensors stay in the DCP files until load_model_state_dict / load_optimizer_state_dict read them
        checkpoint["state_dict"] = {}
        checkpoint["optimizer_states"] = [{} for _ in checkpoint.get("optimizer_param_groups", [])]
        return checkpoint

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        from lightning_parallel.parallel.tensor.checkpoint import load_model

        module = self.lightning_module
        assert module is not None
        folder = checkpoint.get(FOLDER_KEY)
        if folder is not None:
            load_model(folder, module)
            return
        state = dict(module.state_dict())  # a one-device file: place each whole tensor as this rank holds it
        full = checkpoint["state_dict"]
        missing = [name for name in state if name not in full]
        if missing and strict:
            raise KeyError(f"the checkpoint has no {missing[:5]} ({len(missing)} tensors of this rank missing).")
        with torch.no_grad():
            for name, current in state.items():
                if name not in full:
                    continue
                value = full[name]
                if isinstance(current, DTensor):
                    value = distribute_tensor(value.to(current.dtype), current.device_mesh, current.placements)
                current.copy_(value)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        from lightning_parallel.parallel.tensor.checkpoint import apply_optimizer_state, load_optimizer
        from lightning_parallel.parallel.tensor.sync import LocalShardZeroOptimizer

        module = self.lightning_module
        assert module is not None
        folder = checkpoint.get(FOLDER_KEY)
        saved_states = checkpoint.get("optimizer_states", [])
        if folder is None and len(saved_states) != len(self.optimizers):
            raise LayoutError(f"the checkpoint holds {len(saved_states)} optimizer state(s), this run has "
                              f"{len(self.optimizers)} optimizer(s). Fix: resume with the same configure_optimizers.")
        for i, optimizer in enumerate(self.optimizers):
            raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            if folder is not None:
                by_name = load_optimizer(folder, i, module)
            else:
                by_name = self._place_full_optimizer_state(raw, saved_states[i])
            if isinstance(raw, LocalShardZeroOptimizer):
                raw.load_state_by_name(module, by_name)
            else:
                apply_optimizer_state(module, raw, by_name)

    def _place_full_optimizer_state(self, raw: Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
        """A one-device (per-index) optimizer state -> by name, only the parameters this rank holds, each state
        tensor cut like its parameter (a DTensor for tp-sharded ones; cut locally, no collective).

        The indices are matched to names by the one-device numbering: every rank's param-group names, gathered
        and joined as :meth:`merge_saved_param_groups` joins them when saving (one ``all_gather_object``)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        from lightning_parallel.checkpoint.resume import check_state_shapes, optimizer_by_name
        from lightning_parallel.parallel.tensor.sync import LocalShardZeroOptimizer

        module = self.lightning_module
        assert module is not None
        name_of = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        own_groups = raw.original_params if isinstance(raw, LocalShardZeroOptimizer) else [
            list(g["params"]) for g in raw.param_groups]
        live = [{"params": [name_of[id(p)] for p in group]} for group in own_groups]
        gathered: list[Any] = [live]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, live)
        names = [g["params"] for g in self.merge_saved_param_groups(gathered)]
        by_name = optimizer_by_name(saved, names, where="the checkpoint")
        params = dict(module.named_parameters())
        check_state_shapes(by_name, {n: p.shape for n, p in params.items()}, where="the checkpoint")
        state: dict[str, Any] = {}
        for name, slot in by_name["state"].items():
            p = params.get(name)
            if p is None:
                continue  # held by another pipeline stage
            placed: dict[str, Any] = {}
            for key, value in slot.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    value = value.to(device=p.device)
                    if isinstance(p, DTensor):
                        value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
                placed[key] = value
            state[name] = placed
        return {"state": state, "param_groups": by_name["param_groups"]}
