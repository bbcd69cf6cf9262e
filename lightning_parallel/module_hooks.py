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

from typing import Any

from torch import Tensor, nn

from lightning_parallel.config import LayoutError

__all__ = ["TP_STYLES", "ParallelModuleMixin", "require_hook"]

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

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as an ordered sequence of modules, each mapping one tensor to one tensor
        (e.g. ``[embedding, *blocks, head]``); a pipeline cuts it into balanced stages."""
        raise NotImplementedError

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The loss on the last stage's output for one micro-batch (mean over its samples)."""
        raise NotImplementedError

    def pipeline_batch(self, batch: Any) -> tuple[Tensor, Tensor | None]:
        """``(input, target)`` of a batch for the pipeline: the input enters the first stage, the target meets the
        last stage's output in :meth:`pipeline_loss`. Default: ``batch[0], batch[1]`` (a tensor or a 1-tuple: no
        target, for predict); override for dict batches, e.g. ``return batch["tokens"], batch["labels"]``."""
        if isinstance(batch, Tensor):
            return batch, None
        if isinstance(batch, (list, tuple)) and 1 <= len(batch) <= 2:
            return batch[0], batch[1] if len(batch) == 2 else None
        raise TypeError(
            f"pipeline_batch cannot split a {type(batch).__name__} batch into (input, target). Fix: override "
            "pipeline_batch(self, batch) on the module (e.g. return batch['x'], batch['y'])."
        )

    def tensor_parallel_plan(self) -> dict[str, Any]:
        """Submodule name or glob pattern -> one of :data:`TP_STYLES` or a torch ``ParallelStyle`` (e.g.
        ``{"blocks.*.attn.q_proj": "column", "blocks.*.attn.out_proj": "row", ...}``)."""
        raise NotImplementedError

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
        ``{"attention": [names], "batch": {index or key: dim}}``.

        ``attention``: names or ``*`` patterns of the parameter-free submodules whose ``forward(q, k, v)`` computes
        causal ``softmax(q k^T / sqrt(head_dim)) v`` on ``(batch, heads, seq, head_dim)`` tensors, without dropout
        (e.g. ``["blocks.*.attn.core"]``); under cp they run ring (or all-to-all) attention over the cp ranks.
        ``batch``: the sequence dim of each batch tensor to split (``{0: 1, 1: 1}`` for ``(tokens, labels)`` of
        shape ``(b, s)``; a dict batch by key; one int for every tensor). Each rank then sees ``s / cp`` tokens --
        chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp`` -- and computes its loss on them; modules that need token
        positions take them from ``lightning_parallel.parallel.context_parallel.sequence_positions(t, device)``
        instead of ``torch.arange(t)``. See :mod:`lightning_parallel.parallel.context_parallel.plan`."""
        raise NotImplementedError

    def full_checkpointing_modules(self) -> list[str]:
        """Names of the submodules ``activation_checkpointing: full`` recomputes in backward (each keeps only its
        input). Default: every element of :meth:`pipeline_layers` that holds parameters; override to leave out
        layers that are not worth recomputing (the GPT names its blocks only, not its embedding and head)."""
        layers = self.pipeline_layers()
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
