"""The hooks a LightningModule implements so the parallel strategies can restructure it: :class:`ParallelModuleMixin`.

The data-parallel family (``lp_dp``, ``lp_ddp``, ``lp_sharded``, ``lp_zero_offload``) needs none of them: any
LightningModule trains unchanged. Which hook each feature needs:

==================================================  ==============================================================
feature                                             hooks
==================================================  ==============================================================
pipeline parallelism                                :meth:`~ParallelModuleMixin.pipeline_layers`,
                                                    :meth:`~ParallelModuleMixin.pipeline_loss`,
                                                    :meth:`~ParallelModuleMixin.pipeline_batch` (optional)
tensor parallelism                                  :meth:`~ParallelModuleMixin.tensor_parallel_plan`
checks of the layout against the model (optional)   :meth:`~ParallelModuleMixin.parallel_shape`
``activation_checkpointing: full``                  :meth:`~ParallelModuleMixin.pipeline_layers` (or
                                                    :meth:`~ParallelModuleMixin.full_checkpointing_modules`)
``activation_checkpointing: selective``             :meth:`~ParallelModuleMixin.selective_checkpointing_modules`
context parallelism (``context_parallel_size > 1``)  :meth:`~ParallelModuleMixin.context_parallel_plan` (and
                                                    positions from ``sequence_positions``)
==================================================  ==============================================================

:class:`lightning_parallel.models.GPT` implements all of them. A strategy that needs a hook the module lacks refuses
it before launch with :func:`require_hook`, naming the hook to add.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_parallel.config import LayoutError, ParallelConfig

__all__ = ["MAIN_ACTIVATION", "TP_STYLES", "ParallelModuleMixin", "PipelineLayer", "as_pipeline_layer",
           "check_layer_signature", "require_hook"]

MAIN_ACTIVATION = "hidden"
"""The name a plain ``nn.Module`` pipeline layer reads and writes (one tensor in, one tensor out)."""


@dataclass(frozen=True, eq=False)
class PipelineLayer:
    """An element of :meth:`ParallelModuleMixin.pipeline_layers` that reads and returns several named tensors.

    A pipeline carries named activations from layer to layer: the pipeline input (``pipeline_batch``'s first
    element: a tensor, a tuple, or a dict of tensors), then what each layer returns. A plain ``nn.Module`` layer reads
    and replaces :data:`MAIN_ACTIVATION` (one tensor in, one out); a ``PipelineLayer`` says what it reads and returns:

    * ``inputs`` -- the names passed to the layer, positionally, in this order (``optional`` ones as ``None`` when
      the pipeline does not carry them, e.g. an attention mask the batch may hold);
    * ``outputs`` -- the names given to what it returns (a tensor: one name; a tuple: one name per element);
    * ``call`` -- ``call(module, *inputs)`` instead of ``module(*inputs)`` (e.g. to pass keyword arguments).

    Everything else the pipeline carries passes the layer unchanged, and at a stage boundary every carried tensor a
    later layer reads (or the last layer's first output, for the loss) is sent to the next stage, point to point
    over ``pp``. ``module`` must be a submodule of the LightningModule: its parameters belong to the layer's stage.
    """

    module: nn.Module
    inputs: tuple[str, ...] = (MAIN_ACTIVATION,)
    outputs: tuple[str, ...] = (MAIN_ACTIVATION,)
    call: Callable[..., Any] | None = None
    optional: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"PipelineLayer.module must be an nn.Module, got {type(self.module).__name__}.")
        for field_name in ("inputs", "outputs", "optional"):
            value = getattr(self, field_name)
            if isinstance(value, str) or not all(isinstance(n, str) and n for n in value):
                raise TypeError(f"PipelineLayer.{field_name} must be a tuple of names, got {value!r}.")
            object.__setattr__(self, field_name, tuple(value))
        if not self.outputs:
            raise ValueError("PipelineLayer.outputs must name at least one returned tensor.")
        stray = [n for n in self.optional if n not in self.inputs]
        if stray:
            raise ValueError(f"PipelineLayer.optional names {stray}, which are not among its inputs {self.inputs}.")

    def __call__(self, *values: Any) -> Any:
        if self.call is not None:
            return self.call(self.module, *values)
        return self.module(*values)


def as_pipeline_layer(layer: nn.Module | PipelineLayer) -> PipelineLayer:
    """``layer`` as a :class:`PipelineLayer` (a plain module reads and writes :data:`MAIN_ACTIVATION`)."""
    if isinstance(layer, PipelineLayer):
        return layer
    if not isinstance(layer, nn.Module):
        raise TypeError(f"pipeline_layers() holds a {type(layer).__name__}: each element must be an nn.Module or a "
                        "lightning_parallel.PipelineLayer.")
    return PipelineLayer(layer)


def check_layer_signature(layer: PipelineLayer, name: str) -> None:
    """Refuse (:class:`LayoutError`, before launch) a layer whose forward (or ``call``) cannot take its inputs: a
    required argument it would not get, or more positional values than it accepts; names the layer and the
    argument."""
    target: Any = layer.call if layer.call is not None else layer.module.forward
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return
    placeholders = [object()] * (len(layer.inputs) + (1 if layer.call is not None else 0))
    try:
        sig.bind(*placeholders)
    except TypeError as err:
        params = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        given = len(placeholders)
        offset = 1 if layer.call is not None else 0
        missing = [p.name for p in params[given:] if p.default is p.empty and p.kind != p.KEYWORD_ONLY]
        missing += [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
        what = (f"argument {missing[0]!r} has no default and the pipeline does not pass it" if missing else
                f"it takes {len(params) - offset} values, the pipeline would pass {len(layer.inputs)} ({err})")
        kind = "plain pipeline layer (one tensor in, one out)" if layer.call is None and layer.inputs == (
            MAIN_ACTIVATION,) else f"pipeline layer reading {list(layer.inputs)}"
        raise LayoutError(
            f"pipeline layer {name} ({type(layer.module).__name__}) cannot be called as a {kind}: {what}. Fix: "
            f"return it from the previous layer and read it here, e.g. lightning_parallel.PipelineLayer(<{name}>, "
            f"inputs=('hidden', {(missing or ['...'])[0]!r}), outputs=('hidden',)) in pipeline_layers() (the previous "
            "layer's outputs must name it too), or a call= that supplies it."
        ) from None

TP_STYLES = ("column", "row", "vocab", "sequence", "sequence_scatter", "replicate")
"""How a submodule splits under TP: ``column`` (output features over ``tp``), ``row`` (input features, all-reduce
in forward), ``vocab`` (embedding rows / head columns over ``tp``, with a vocab-parallel loss), ``sequence`` (a norm
run on its sequence shard under ``sequence_parallel``), ``sequence_scatter`` (a module whose output is split along
the sequence under ``sequence_parallel``, e.g. token + learned position embeddings), ``replicate`` (kept whole).
See :mod:`lightning_parallel.parallel.tensor.plan` for what each style shards and communicates."""


class ParallelModuleMixin:
    """Mix into a LightningModule (``class MyModel(ParallelModuleMixin, LightningModule)``) and override the hooks
    the chosen strategy needs; a hook left as is raises ``NotImplementedError`` (``parallel_shape`` returns ``{}``
    and ``full_checkpointing_modules`` derives from ``pipeline_layers``).

    Names are fully qualified submodule names relative to the LightningModule (``module.get_submodule(name)``),
    e.g. ``"blocks.0.attn.q_proj"``. Every hook must work on a module whose layers were pruned for a pipeline stage
    (only the layers that are present are returned or named)."""

    def pipeline_layers(self) -> Sequence[nn.Module | PipelineLayer]:
        """The model as an ordered sequence of layers (e.g. ``[embedding, *blocks, head]``); a pipeline cuts it into
        balanced stages. A plain module maps one tensor to one tensor; a :class:`PipelineLayer` reads and returns
        several named tensors (hidden states plus a mask or position embeddings the later layers need)."""
        raise NotImplementedError

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The loss on the last stage's output for one micro-batch (mean over its samples)."""
        raise NotImplementedError

    def pipeline_batch(self, batch: Any) -> tuple[Any, Tensor | None]:
        """``(input, target)`` of a batch for the pipeline: the input enters the first stage, the target meets the
        last stage's output in :meth:`pipeline_loss`. Default: ``batch[0], batch[1]`` (a tensor or a 1-tuple: no
        target, for predict); override for dict batches, e.g. ``return batch["tokens"], batch["labels"]``. The input
        may also be a dict of tensors (their names are what the first :class:`PipelineLayer` reads) or a tuple (the
        first layer's inputs, in order); every input tensor is split into micro-batches along dim 0."""
        if isinstance(batch, Tensor):
            return batch, None
        if isinstance(batch, (list, tuple)) and 1 <= len(batch) <= 2:
            return batch[0], batch[1] if len(batch) == 2 else None
        entries = f" of {len(batch)} entries" if isinstance(batch, (list, tuple)) else ""
        raise TypeError(
            f"pipeline_batch cannot split a {type(batch).__name__} batch{entries} into (input, target): the default "
            "takes a tensor, (input,) or (input, target). Fix: override pipeline_batch(self, batch) on the module "
            "(e.g. return batch['x'], batch['y'], or batch[0], batch[1] for (x, y, index) batches)."
        )

    def tensor_parallel_plan(self) -> dict[str, Any]:
        """Submodule name or glob pattern -> one of :data:`TP_STYLES` or a torch ``ParallelStyle`` (e.g.
        ``{"blocks.*.attn.q_proj": "column", "blocks.*.attn.out_proj": "row", ...}``)."""
        raise NotImplementedError

    def check_parallel_layout(self, layout: ParallelConfig) -> None:
        """Refuse, before launch, a layout this module cannot run (raise :class:`~lightning_parallel.LayoutError`
        with the key, the value, the reason and the fix); called by every layout strategy after its shape checks and
        before the context-parallel, recomputation and compile checks.
        Default: nothing."""

    def parallel_shape(self) -> dict[str, int]:
        """Shape facts the layout is checked against before launch: ``n_layer``, ``n_head``, ``vocab_size``
        (of the whole model, also when this instance holds one pipeline stage); ``{}`` skips the checks."""
        return {}

    def selective_checkpointing_modules(self) -> list[str]:
        """Names of the parameter-free submodules ``activation_checkpointing: selective`` recomputes in backward:
        the attention cores (``softmax(q k^T / sqrt(d)) v`` with its dropout), whose activations grow with the
        square of the sequence length and cost little to recompute (e.g. ``["blocks.0.attn.core", ...]``)."""
        raise NotImplementedError

    def context_parallel_plan(self) -> dict[str, Any]:
        """What context parallelism (``parallel.context_parallel_size`` > 1) routes and splits:
        ``{"attention": [names], "batch": {index or key: dim}, "labels": index or key}``.

        ``attention``: names or ``*`` patterns of the parameter-free submodules whose ``forward(q, k, v)`` computes
        causal ``softmax(q k^T / sqrt(head_dim)) v`` on ``(batch, heads, seq, head_dim)`` tensors, without dropout
        (e.g. ``["blocks.*.attn.core"]``); under cp they run ring (or all-to-all) attention over the cp ranks.
        ``batch``: the sequence dim of each batch tensor to split (``{0: 1, 1: 1}`` for ``(tokens, labels)`` of
        shape ``(b, s)``; a dict batch by key; one int for every tensor). Each rank then sees ``s / cp`` tokens --
        chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp`` -- and computes its loss on them; modules that need token
        positions take them from ``lightning_parallel.parallel.context_parallel.sequence_positions(t, device)``
        instead of ``torch.arange(t)``. ``labels`` (optional): the batch entry of the token labels of a loss that is
        the mean over the counted tokens (labels other than ``ignore_index``, default -100): each rank's loss is then
        weighed by its share of the counted tokens, so ignored labels that fall unevenly over the ranks' chunks
        (padding, masked prompts) weigh as on one device -- and at any cp (only ``labels`` and ``ignore_index`` are
        read at cp = 1) the dp ranks' batches, a pipeline's micro-batches and a step's accumulated batches are
        weighed the same way. ``labels`` may also be a function ``batch -> labels`` returning them as the loss counts
        them (a loss that shifts its labels inside): it weighs dp ranks, micro-batches and accumulated batches, and is
        refused at cp > 1 (the labels are cut along the sequence there). See
        :mod:`lightning_parallel.parallel.context_parallel.plan`."""
        raise NotImplementedError

    def full_checkpointing_modules(self) -> list[str]:
        """Names of the submodules ``activation_checkpointing: full`` recomputes in backward (each keeps only its
        input). Default: every element of :meth:`pipeline_layers` that holds parameters; override to leave out
        layers that are not worth recomputing (the GPT names its blocks only, not its embedding and head)."""
        layers = [as_pipeline_layer(layer).module for layer in self.pipeline_layers()]
        root: Any = self
        names = {id(m): name for name, m in root.named_modules() if name}
        return [names[id(layer)] for layer in layers if id(layer) in names and any(True for _ in layer.parameters())]


def require_hook(module: Any, hook: str, *, strategy: str) -> None:
    """Refuse, before launch, a module that lacks a hook ``strategy`` needs, naming the hook to add."""
    impl = getattr(type(module), hook, None)
    base = getattr(ParallelModuleMixin, hook)
    if impl is None or impl is base:
        raise LayoutError(
            f"{type(module).__name__} cannot run under {strategy}: it does not implement `{hook}()`. "
            f"Fix: subclass lightning_parallel.ParallelModuleMixin and implement `{hook}` "
            f"({getattr(base, '__doc__', '').strip().splitlines()[0]}), as lightning_parallel.models.GPT does."
        )
