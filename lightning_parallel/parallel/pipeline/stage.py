"""Cut a module into this rank's pipeline stages, keeping the module's own parameter names.

:func:`plan_stages` reads the module's ordered layers (``pipeline_layers()``) and decides, for every stage, which of
them it runs; :func:`prune_to` removes every other layer from the module itself (a layer in an ``nn.ModuleDict``
is deleted, one held as an attribute is set to ``None``, one in an ``nn.ModuleList``/``nn.Sequential`` is replaced
by a parameter-free :class:`PrunedLayer` so its siblings keep their indices). The pruned LightningModule is what the
optimizer, ``state_dict()`` and checkpoints see: ``blocks.3.attn.q_proj.weight`` on the stage that holds block 3, as
in the whole model, so a checkpoint keyed by name fits any cut. :class:`StageChunk` strings a stage's layers
together for torch's ``PipelineStage`` (it registers the same module objects; no copies).

A module built on the meta device is materialized after pruning (:func:`materialize`): only the layers this rank
keeps get memory, then the module's ``init_weights()`` fills them. No Lightning import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .partition import stage_ranges, stages_of_rank

__all__ = ["PrunedLayer", "StageChunk", "StagePlan", "has_meta_tensors", "layer_names", "materialize", "plan_stages",
           "prune_to"]


class PrunedLayer(nn.Module):
    """Stands in for a layer another pipeline rank holds, inside an ``nn.ModuleList``/``nn.Sequential`` (so the
    indices, hence the names, of the layers that stay do not shift). Holds nothing; calling it is an error."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.pruned_name = name

    def forward(self, *args: object, **kwargs: object) -> Tensor:
        raise RuntimeError(f"layer {self.pruned_name!r} lives on another pipeline stage; it cannot run here.")


class StageChunk(nn.Module):
    """One pipeline stage: its layers applied in order (each maps one tensor to one tensor)."""

    def __init__(self, layers: list[nn.Module], names: list[str]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.names = names

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass(frozen=True)
class StagePlan:
    """How the whole model is cut: ``ranges[s]`` = the ``[start, stop)`` of stage ``s`` in ``names`` (the FQNs of
    ``pipeline_layers()``), and which stages pipeline rank ``pp_rank`` runs."""

    names: tuple[str, ...]
    ranges: tuple[tuple[int, int], ...]
    pp: int
    chunks: int
    pp_rank: int

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    @property
    def my_stages(self) -> list[int]:
        return stages_of_rank(self.pp_rank, self.pp, self.chunks)

    @property
    def kept(self) -> list[str]:
        """FQNs of the layers this rank keeps."""
        return [self.names[i] for s in self.my_stages for i in range(*self.ranges[s])]

    def describe(self) -> str:
        """``stage 0: embed, blocks.0 | stage 1: blocks.1, head`` (first and last layer of each stage)."""
        parts = []
        for s, (a, b) in enumerate(self.ranges):
            span = self.names[a] if b - a == 1 else f"{self.names[a]} .. {self.names[b - 1]}"
            parts.append(f"stage {s} (pp rank {s % self.pp}): {span} ({b - a} layer{'s' if b - a != 1 else ''})")
        return "; ".join(parts)


def layer_names(module: nn.Module, layers: list[nn.Module]) -> list[str]:
    """The FQN of each layer inside ``module``; ValueError for a layer that is not a submodule (or is the module)."""
    where = {id(m): name for name, m in module.named_modules() if name}
    names = []
    for i, layer in enumerate(layers):
        if id(layer) not in where:
            raise ValueError(f"pipeline_layers()[{i}] ({type(layer).__name__}) is not a submodule of "
                             f"{type(module).__name__}: every pipeline layer must be registered on the module.")
        names.append(where[id(layer)])
    if len(set(names)) != len(names):
        raise ValueError(f"pipeline_layers() lists a layer twice: {names}.")
    return names


def _param_count(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def plan_stages(module: nn.Module, layers: list[nn.Module], *, pp: int, chunks: int, pp_rank: int,
                layers_per_stage: list[int] | None = None) -> StagePlan:
    """Cut ``layers`` (the module's ``pipeline_layers()``) into ``pp x chunks`` stages: balanced by parameter count
    (works on the meta device) unless ``layers_per_stage`` gives each stage's layer count."""
    names = layer_names(module, layers)
    ranges = stage_ranges(len(layers), pp * chunks, weights=[max(1, _param_count(m)) for m in layers],
                          layers_per_stage=layers_per_stage)
    return StagePlan(tuple(names), tuple(ranges), pp, chunks, pp_rank)


def prune_to(module: nn.Module, plan: StagePlan) -> list[StageChunk]:
    """Remove every pipeline layer this rank does not run from ``module`` (in place) and return its stage chunks.

    Also removes what only those layers shared with nothing else; a parameter shared between a kept and a removed
    layer (tied embeddings) is refused before this point by the strategy.
    """
    keep = set(plan.kept)
    chunks: list[StageChunk] = []
    for s in plan.my_stages:
        a, b = plan.ranges[s]
        chunks.append(StageChunk([module.get_submodule(plan.names[i]) for i in range(a, b)],
                                 list(plan.names[a:b])))
    for name in plan.names:
        if name in keep:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        if isinstance(parent, nn.ModuleDict):
            del parent[attr]
        elif isinstance(parent, (nn.ModuleList, nn.Sequential)):
            parent._modules[attr] = PrunedLayer(name)
        else:
            setattr(parent, attr, None)
    return chunks


def has_meta_tensors(module: nn.Module) -> bool:
    """True if any parameter or buffer is on the meta device (the module was built without memory)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize(module: nn.Module, device: torch.device, *, seed: int) -> None:
    """Give a meta-device (pruned) module real memory on ``device`` and initialize it with its ``init_weights()``
    after ``torch.manual_seed(seed)``: the present layers then hold what the whole model built on ``device`` after
    the same seed holds, when ``init_weights`` walks the whole model's draws (as the library's GPT does)."""
    init = getattr(module, "init_weights", None)
    if not callable(init):
        raise ValueError(f"{type(module).__name__} was built on the meta device but has no init_weights(): a pipeline "
                         "stage cannot fill its layers. Fix: implement init_weights() (see the library's GPT), or "
                         "build the module on a real device.")
    module.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        init()
