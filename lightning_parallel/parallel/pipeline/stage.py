"""Cut a module into this rank's pipeline stages, keeping the module's own parameter names.

:func:`plan_stages` reads the module's ordered layers (``pipeline_layers()``) and decides, for every stage, which of
them it runs; :func:`prune_to` removes every other layer from the module itself (a layer in an ``nn.ModuleDict``
is deleted, one held as an attribute is set to ``None``, one in an ``nn.ModuleList``/``nn.Sequential`` is replaced
by a parameter-free :class:`PrunedLayer` so its siblings keep their indices). The pruned LightningModule is what the
optimizer, ``state_dict()`` and checkpoints see: ``blocks.3.attn.q_proj.weight`` on the stage that holds block 3, as
in the whole model, so a checkpoint keyed by name fits any cut. :class:`StageChunk` strings a stage's layers
together for torch's ``PipelineStage`` (it registers the same module objects; no copies).

Several tensors between stages: the layers carry named activations
(:class:`~lightning_parallel.module_hooks.PipelineLayer`; a plain module reads and writes ``"hidden"``). Which names
cross each stage boundary follows from the layers' inputs and outputs and from the names the pipeline input holds
(:meth:`StagePlan.boundaries`): every carried tensor a later layer reads, plus the last layer's first output. A stage
receives and sends them as one tuple of tensors (torch's ``PipelineStage`` sends each one point to point, and the
gradients of those that require one back).

A module built on the meta device is materialized after pruning (:func:`materialize`): only the layers this rank
keeps get memory, then the module's ``init_weights()`` fills them. No Lightning import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.module_hooks import PipelineLayer, as_pipeline_layer

from .partition import stage_ranges, stages_of_rank

__all__ = ["META_BY_CHECK", "LayerFlow", "PipelineFlowError", "PrunedLayer", "StageChunk", "StagePlan",
           "has_meta_tensors", "input_names", "layer_names", "materialize", "needs_init_weights", "plan_stages",
           "prune_to"]


class PipelineFlowError(ValueError):
    """A layer reads a tensor that neither the pipeline input nor an earlier layer provides."""


@dataclass(frozen=True)
class LayerFlow:
    """What one pipeline layer reads and returns, by name (the static part of a
    :class:`~lightning_parallel.module_hooks.PipelineLayer`)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    optional: tuple[str, ...] = ()

    @classmethod
    def of(cls, layer: nn.Module | PipelineLayer) -> LayerFlow:
        spec = as_pipeline_layer(layer)
        return cls(spec.inputs, spec.outputs, spec.optional)


def input_names(inputs: Any, first: LayerFlow) -> tuple[tuple[str, ...], tuple[Tensor, ...]]:
    """The names and tensors of a pipeline input: a dict (its keys), a tuple or list (the first layer's inputs in
    order), or one tensor (the first layer's first input)."""
    if isinstance(inputs, Tensor):
        return (first.inputs[0],), (inputs,)
    if isinstance(inputs, dict):
        names, values = tuple(inputs), tuple(inputs.values())
    elif isinstance(inputs, (tuple, list)):
        if len(inputs) > len(first.inputs):
            raise PipelineFlowError(
                f"the pipeline input is a tuple of {len(inputs)} tensors, but the first layer reads only "
                f"{list(first.inputs)}. Fix: return a dict of named tensors from pipeline_batch, or read them all in "
                "the first PipelineLayer."
            )
        names, values = first.inputs[: len(inputs)], tuple(inputs)
    else:
        raise PipelineFlowError(f"a pipeline input must be a tensor, a tuple or a dict of tensors, got "
                                f"{type(inputs).__name__}.")
    bad = [n for n, v in zip(names, values, strict=True) if not isinstance(v, Tensor)]
    if bad:
        raise PipelineFlowError(f"pipeline input {bad[0]!r} is not a tensor: every pipeline input is a tensor split "
                                "into micro-batches along dim 0.")
    return names, values


class PrunedLayer(nn.Module):
    """Stands in for a layer another pipeline rank holds, inside an ``nn.ModuleList``/``nn.Sequential`` (so the
    indices, hence the names, of the layers that stay do not shift). Holds nothing; calling it is an error."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.pruned_name = name

    def forward(self, *args: object, **kwargs: object) -> Tensor:
        raise RuntimeError(f"layer {self.pruned_name!r} lives on another pipeline stage; it cannot run here.")


class StageChunk(nn.Module):
    """One pipeline stage: its layers applied in order to the named tensors the pipeline carries.

    Before a step, :meth:`bind` tells it which names arrive (positionally, in that order) and which it hands on;
    ``forward(*tensors)`` returns one tensor when it hands on one, else a tuple (what torch's ``PipelineStage`` sends
    to the next stage, or the last stage's output for the loss)."""

    def __init__(self, layers: list[nn.Module | PipelineLayer], names: list[str]) -> None:
        super().__init__()
        self.specs = [as_pipeline_layer(layer) for layer in layers]
        self.layers = nn.ModuleList(spec.module for spec in self.specs)
        self.names = names
        self.receives: tuple[str, ...] = (self.specs[0].inputs[0],) if self.specs else ()
        self.sends: tuple[str, ...] = (self.specs[-1].outputs[0],) if self.specs else ()

    def bind(self, receives: Sequence[str], sends: Sequence[str]) -> None:
        """The names of the tensors this stage receives and of those it sends on, in order."""
        self.receives, self.sends = tuple(receives), tuple(sends)

    def forward(self, *values: Tensor) -> Tensor | tuple[Tensor, ...]:
        if len(values) != len(self.receives):
            raise RuntimeError(f"pipeline stage ({self.names[0]} ..) got {len(values)} tensors, expected "
                               f"{len(self.receives)} ({list(self.receives)}).")
        carry: dict[str, Any] = dict(zip(self.receives, values, strict=True))
        for spec, name in zip(self.specs, self.names, strict=True):
            args = [carry.get(n) if n in spec.optional else carry[n] for n in spec.inputs]
            out = spec(*args)
            if len(spec.outputs) == 1:
                carry[spec.outputs[0]] = out
            else:
                if not isinstance(out, (tuple, list)) or len(out) != len(spec.outputs):
                    got = f"{len(out)} values" if isinstance(out, (tuple, list)) else type(out).__name__
                    raise RuntimeError(f"pipeline layer {name} returned {got}, but its PipelineLayer.outputs names "
                                       f"{len(spec.outputs)}: {list(spec.outputs)}.")
                carry.update(zip(spec.outputs, out, strict=True))
        result = tuple(carry[n] for n in self.sends)
        return result[0] if len(result) == 1 else result


@dataclass(frozen=True)
class StagePlan:
    """How the whole model is cut: ``ranges[s]`` = the ``[start, stop)`` of stage ``s`` in ``names`` (the FQNs of
    ``pipeline_layers()``), and which stages pipeline rank ``pp_rank`` runs."""

    names: tuple[str, ...]
    ranges: tuple[tuple[int, int], ...]
    pp: int
    chunks: int
    pp_rank: int
    flows: tuple[LayerFlow, ...] = ()
    """What each layer reads and returns (default: one tensor in, one out)."""

    def flow(self, i: int) -> LayerFlow:
        return self.flows[i] if self.flows else LayerFlow(("hidden",), ("hidden",))

    def boundaries(self, roots: Sequence[str]) -> list[tuple[str, ...]]:
        """For a pipeline input holding the tensors ``roots`` (in order): the names entering each stage (entry 0:
        ``roots``) and, last, the stage output handed to the loss -- ``num_stages + 1`` entries. Raises
        :class:`PipelineFlowError` naming the layer and the input no one provides."""
        n = len(self.names)
        order = list(dict.fromkeys(roots))
        present = set(order)
        for i in range(n):
            flow = self.flow(i)
            for name in flow.inputs:
                if name not in present and name not in flow.optional:
                    raise PipelineFlowError(
                        f"pipeline layer {self.names[i]} reads {name!r}, which neither the pipeline input "
                        f"({sorted(roots)}) nor an earlier layer provides. Fix: return it from pipeline_batch or "
                        "from an earlier PipelineLayer's outputs, or list it in the layer's optional inputs."
                    )
            for name in flow.outputs:
                if name not in present:
                    present.add(name)
                    order.append(name)
        final = self.flow(n - 1).outputs[0]
        needed_after: list[set[str]] = [set() for _ in range(n + 1)]
        needed_after[n] = {final}
        for i in range(n - 1, -1, -1):
            needed_after[i] = needed_after[i + 1] | set(self.flow(i).inputs)
        # what is present before layer i: the roots plus every output of layers < i
        before: list[set[str]] = [set(roots)]
        for i in range(n):
            before.append(before[-1] | set(self.flow(i).outputs))
        out = [tuple(dict.fromkeys(roots))]
        for a, _b in self.ranges[1:]:
            out.append(tuple(x for x in order if x in before[a] and x in needed_after[a]))
        out.append((final,))
        return out

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


def layer_names(module: nn.Module, layers: Sequence[nn.Module | PipelineLayer]) -> list[str]:
    """The FQN of each layer inside ``module``; ValueError for a layer that is not a submodule (or is the module)."""
    where = {id(m): name for name, m in module.named_modules() if name}
    names = []
    for i, layer in enumerate(as_pipeline_layer(x).module for x in layers):
        if id(layer) not in where:
            raise ValueError(f"pipeline_layers()[{i}] ({type(layer).__name__}) is not a submodule of "
                             f"{type(module).__name__}: every pipeline layer must be registered on the module.")
        names.append(where[id(layer)])
    if len(set(names)) != len(names):
        raise ValueError(f"pipeline_layers() lists a layer twice: {names}.")
    return names


def _param_count(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def plan_stages(module: nn.Module, layers: Sequence[nn.Module | PipelineLayer], *, pp: int, chunks: int,
                pp_rank: int, layers_per_stage: list[int] | None = None) -> StagePlan:
    """Cut ``layers`` (the module's ``pipeline_layers()``) into ``pp x chunks`` stages: balanced by parameter count
    (works on the meta device) unless ``layers_per_stage`` gives each stage's layer count."""
    names = layer_names(module, layers)
    modules = [as_pipeline_layer(x).module for x in layers]
    ranges = stage_ranges(len(layers), pp * chunks, weights=[max(1, _param_count(m)) for m in modules],
                          layers_per_stage=layers_per_stage)
    return StagePlan(tuple(names), tuple(ranges), pp, chunks, pp_rank, tuple(LayerFlow.of(x) for x in layers))


def prune_to(module: nn.Module, plan: StagePlan,
             layers: Sequence[nn.Module | PipelineLayer] | None = None) -> list[StageChunk]:
    """Remove every pipeline layer this rank does not run from ``module`` (in place) and return its stage chunks.

    ``layers``: the ``pipeline_layers()`` the plan was made from (their :class:`PipelineLayer` specs; default: the
    plain submodules named by the plan). Also removes what only those layers shared with nothing else; a parameter
    shared between a kept and a removed layer (tied embeddings) is refused before this point by the strategy.
    """
    keep = set(plan.kept)
    chunks: list[StageChunk] = []
    for s in plan.my_stages:
        a, b = plan.ranges[s]
        chunks.append(StageChunk([layers[i] if layers is not None else module.get_submodule(plan.names[i])
                                  for i in range(a, b)], list(plan.names[a:b])))
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


META_BY_CHECK = "_lp_meta_by_check"
"""Set on a module ``lightning-parallel check`` built on the meta device itself (``fit`` builds it on a real one)."""


def needs_init_weights(module: nn.Module) -> bool:
    """True when a pipeline must fill the module's layers with its ``init_weights()``: the user built it on the meta
    device (not ``lightning-parallel check``, which builds every model there and must judge it as ``fit`` would)."""
    return has_meta_tensors(module) and not module.__dict__.get(META_BY_CHECK, False)


def materialize(module: nn.Module, device: torch.device, *, seed: int) -> None:
    """Give a meta-device (pruned) module real memory on ``device`` and initialize it with its ``init_weights()``
    after ``torch.manual_seed(seed)``: the present layers then hold what the whole model built on ``device`` after
    the same seed holds, when ``init_weights`` walks the whole model's draws (as the library's GPT does)."""
    init = getattr(module, "init_weights", None)
    if not callable(init):
        raise ValueError(f"{type(module).__name__} was built on the meta device but has no init_weights(): its "
                         "tensors cannot be filled once given memory. Fix: implement init_weights() (see the "
                         "library's GPT), or build the module on a real device.")
    module.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        init()
