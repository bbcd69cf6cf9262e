"""The reference GPT: a pre-LN decoder-only transformer as a LightningModule, ready for PP and TP.

Structure (what the parallel strategies rely on):

* ``pipeline_layers()`` returns the model as an ordered sequence ``[embedding, block_0, ..., block_{L-1}, head]``;
  each element maps one tensor to one tensor (token ids -> hidden -> ... -> logits), so a pipeline can cut the
  sequence anywhere; ``pipeline_loss(logits, targets)`` is the loss on the last stage's output.
* Parameter names are stable under that cut: the blocks live in an ``nn.ModuleDict`` keyed ``"0"`` ..
  ``"L-1"`` (``blocks.3.attn.q_proj.weight`` on every stage that holds block 3, as in the whole model), and a
  stage is the whole model with the other layers removed (``model.embed = None``, ``del model.blocks["0"]``,
  ``model.head = None``); ``forward``, ``pipeline_layers`` and ``tensor_parallel_plan`` skip what is absent and
  ``parallel_shape`` reports the whole model. So a checkpoint keyed by parameter name (as torch DCP's are) fits any
  split of the layers.
* Weight init is :meth:`GPT.init_weights`, so a stage can be built on the meta device and materialized:
  ``with torch.device("meta"): m = GPT(...)``, prune, ``m.to_empty(device=d)``, ``torch.manual_seed(s)``,
  ``m.init_weights()`` -- the present weights then equal those of ``GPT(...)`` built whole on ``d`` after
  ``torch.manual_seed(s)``.
* ``selective_checkpointing_modules()`` names each block's ``attn.core`` (the parameter-free attention core) and
  ``full_checkpointing_modules()`` each block, for :mod:`lightning_parallel.parallel.activation_checkpointing`.
* ``tensor_parallel_plan()`` names how each linear splits for Megatron-style tensor parallelism: q/k/v and the MLP's
  first linear column-parallel (output features sharded over ``tp``), the attention output and the MLP's second
  linear row-parallel (input features sharded, one all-reduce in forward), the embedding and head vocab-parallel.

Optimizer: AdamW (weight decay on matrices only) with linear warmup then cosine decay to ``min_lr_ratio * lr``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.checkpoint.read import LoadsAnyFormat
from lightning_parallel.module_hooks import ParallelModuleMixin
from lightning_parallel.parallel.context_parallel import sequence_length, sequence_positions

__all__ = ["GPT", "MLP", "AttentionCore", "Block", "CausalSelfAttention", "Embedding", "Head"]


class AttentionCore(nn.Module):
    """The attention core ``dropout(softmax(q k^T / sqrt(d) + causal mask)) v`` on ``(b, heads, t, d)`` tensors.

    Parameter-free, so recomputing it in backward (``activation_checkpointing: selective``) needs only q, k and v:
    it drops the activations that grow with the square of the sequence length (the attention probabilities, their
    dropout mask and output), at the cost of one more attention forward. Dropout is applied only in training.
    """

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate ``q_proj``/``k_proj``/``v_proj`` and ``out_proj``.

    Under TP the heads are split over ``tp``: q/k/v are column-parallel (each rank computes ``n_head / tp`` heads),
    ``out_proj`` is row-parallel (partial sums all-reduced over ``tp`` in forward; identity in backward).
    The parameter-free attention core is its own submodule, ``core`` (:class:`AttentionCore`).
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head} ({n_embd} % {n_head} != 0).")
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.q_proj = nn.Linear(n_embd, n_embd, bias=bias)
        # No key bias: it adds q.b_k to every score of a query, which softmax ignores, so its true gradient is zero
        # and Adam would turn the rounding noise left in it into lr-sized updates (runs would not be reproducible).
        self.k_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.v_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.core = AttentionCore(dropout)
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    @property
    def dropout(self) -> float:
        """The attention-probability dropout (held by :attr:`core`)."""
        return self.core.dropout

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        # -1 heads: under TP each rank holds n_head / tp heads, inferred from the (sharded) projection width.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = self.core(q, k, v).transpose(1, 2).reshape(b, t, -1)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    """``fc_in`` (column-parallel under TP) -> GELU -> ``fc_out`` (row-parallel)."""

    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc_in = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.fc_out = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.fc_out(F.gelu(self.fc_in(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token + learned position embedding (kept in one module so a sequence-sharded layout can re-lay it out)."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.block_size = block_size

    def forward(self, idx: Tensor) -> Tensor:
        t = sequence_length(idx.shape[1])  # the whole sequence's length (this rank holds t / cp tokens under cp)
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.block_size}.")
        pos = sequence_positions(idx.shape[1], device=idx.device)  # this rank's global positions under cp
        return self.drop(self.tok(idx) + self.pos(pos))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection ``lm_head`` (vocab-parallel under TP)."""

    def __init__(self, n_embd: int, vocab_size: int, bias: bool) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(ParallelModuleMixin, LoadsAnyFormat, pl.LightningModule):
    """A GPT language model (pre-LN decoder) trained with next-token cross-entropy.

    Submodules: ``embed`` (:class:`Embedding`), ``blocks`` (an ``nn.ModuleDict`` of :class:`Block` keyed ``"0"``
    .. ``"L-1"``) and ``head`` (:class:`Head`). On a pipeline stage ``embed`` and ``head`` may be ``None`` or
    deleted and ``blocks`` may hold a subset of the keys; every method below works on what is present.

    Args:
        n_layer: transformer blocks. n_head: attention heads. n_embd: hidden size (divisible by n_head).
        block_size: maximum sequence length. vocab_size: tokens (256 for byte-level text).
        dropout: dropout probability (0 keeps training deterministic). bias: biases in linears and LayerNorms.
        tie_embeddings: share the token embedding with ``lm_head`` (off by default: a tied weight spans the first
            and last pipeline stage).
        lr, weight_decay, betas: AdamW. warmup_steps: linear warmup. min_lr_ratio: cosine floor as a fraction of lr.
    """

    embed: Embedding | None
    blocks: nn.ModuleDict
    head: Head | None

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 128,
        vocab_size: int = 256,
        dropout: float = 0.0,
        bias: bool = True,
        tie_embeddings: bool = False,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        for name, value in (("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd),
                            ("block_size", block_size), ("vocab_size", vocab_size)):
            if value < 1:
                raise ValueError(f"GPT {name}={value} must be >= 1.")
        embed = self.embed = self._new_layer("embed")
        self.blocks = nn.ModuleDict({str(i): self._new_layer("block") for i in range(n_layer)})
        head = self.head = self._new_layer("head")
        if tie_embeddings:
            head.lm_head.weight = embed.tok.weight
        self.init_weights(default_init=False)  # the constructors above made the default-init draws already

    # ------------------------------------------------------------------ layers and init
    def _new_layer(self, kind: str) -> Any:
        hp: Any = self.hparams
        if kind == "embed":
            return Embedding(hp.vocab_size, hp.block_size, hp.n_embd, hp.dropout)
        if kind == "head":
            return Head(hp.n_embd, hp.vocab_size, hp.bias)
        return Block(hp.n_embd, hp.n_head, hp.dropout, hp.bias)

    def _present_blocks(self) -> list[tuple[str, nn.Module]]:
        """``(key, block)`` of the blocks on this instance, in layer order."""
        blocks = getattr(self, "blocks", None)
        if blocks is None:
            return []
        return sorted(blocks.items(), key=lambda item: int(item[0]))

    def _layer_slots(self) -> Iterator[tuple[str, nn.Module | None]]:
        """Every layer of the whole model in order -- ``embed``, ``block`` x n_layer, ``head`` -- with the module
        when this instance holds it, else ``None``."""
        hp: Any = self.hparams
        blocks = getattr(self, "blocks", None)
        yield "embed", getattr(self, "embed", None)
        for i in range(hp.n_layer):
            yield "block", blocks[str(i)] if blocks is not None and str(i) in blocks else None
        yield "head", getattr(self, "head", None)

    def init_weights(self, *, default_init: bool = True) -> None:
        """(Re-)initialize the parameters present, in place, from the default random generator of their device.

        Draws, in this order, each step walking the whole model's layers (``embed``, blocks ``"0"`` ..
        ``"L-1"``, ``head``): (1) if ``default_init``, each ``nn.Linear`` / ``nn.Embedding`` / ``nn.LayerNorm``'s
        own ``reset_parameters()`` (the draws their constructors make); (2) GPT-2's init: normal(0, 0.02) for
        linear and embedding weights, zero linear biases; (3) normal(0, 0.02 / sqrt(2 n_layer)) for the residual
        projections ``attn.out_proj`` and ``mlp.fc_out``. For a layer absent from this instance (a pipeline stage)
        the same numbers are drawn into a scratch copy of it and dropped, so the generator advances exactly as for
        the whole model.

        Hence, after ``torch.manual_seed(s)``, a model built on the meta device, pruned to any stage and
        materialized with ``to_empty(device=d)`` holds, after ``init_weights()``, exactly the weights that
        ``GPT(...)`` built whole on ``d`` right after ``torch.manual_seed(s)`` holds: the constructor runs step (1)
        through the submodules' constructors and then calls ``init_weights(default_init=False)``. Call it before
        the model is sharded or tensor-parallelized. With ``tie_embeddings`` it ties ``head.lm_head.weight`` to
        ``embed.tok.weight`` again when both are present (``to_empty`` unties them).
        """
        hp: Any = self.hparams
        present = next(self.parameters(), None)
        if present is None:
            return
        embed, head = getattr(self, "embed", None), getattr(self, "head", None)
        if hp.tie_embeddings and embed is not None and head is not None and head.lm_head.weight is not embed.tok.weight:
            head.lm_head.weight = embed.tok.weight
        residual_std = 0.02 / math.sqrt(2 * hp.n_layer)

        def constructor_init(layer: nn.Module) -> None:
            for sub in layer.modules():
                if isinstance(sub, (nn.Linear, nn.Embedding, nn.LayerNorm)):
                    sub.reset_parameters()

        def residual_init(layer: nn.Module) -> None:
            for name, p in layer.named_parameters():
                if name.endswith(("out_proj.weight", "fc_out.weight")):  # GPT-2 scaled init of residual projections
                    nn.init.normal_(p, mean=0.0, std=residual_std)

        steps: list[Callable[[nn.Module], Any]] = [lambda layer: layer.apply(self._init_weights), residual_init]
        if default_init:
            steps.insert(0, constructor_init)
        with torch.no_grad():
            for step in steps:
                for kind, layer in self._layer_slots():
                    if layer is None:
                        with torch.device("meta"):
                            layer = self._new_layer(kind)
                        layer = layer.to_empty(device=present.device).to(present.dtype)
                    step(layer)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # ------------------------------------------------------------------ parallel structure
    def pipeline_layers(self) -> list[nn.Module]:
        """``[embed, blocks["0"], ..., blocks["L-1"], head]``, leaving out the layers absent on this instance."""
        embed, head = getattr(self, "embed", None), getattr(self, "head", None)
        layers: list[nn.Module] = [] if embed is None else [embed]
        layers.extend(block for _, block in self._present_blocks())
        return layers if head is None else [*layers, head]

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        logits = output.reshape(-1, output.size(-1))
        if logits.dtype in (torch.float16, torch.bfloat16):  # half-precision logits: the loss in fp32 (not fp64's)
            logits = logits.float()
        return F.cross_entropy(logits, target.reshape(-1))

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Megatron's split: q/k/v and ``fc_in`` column, ``out_proj`` and ``fc_out`` row, the token embedding and
        ``lm_head`` vocab-parallel (the loss is then a vocab-parallel cross-entropy), the norms ``sequence`` (with
        ``sequence_parallel`` they run on this rank's sequence shard), and ``embed`` ``sequence_scatter``: token and
        learned position embeddings are added whole, then split along the sequence, so positions stay right."""
        plan = {}
        if getattr(self, "embed", None) is not None:
            plan["embed.tok"] = "vocab"
            plan["embed"] = "sequence_scatter"
        if getattr(self, "head", None) is not None:
            plan["head.lm_head"] = "vocab"
            plan["head.ln_f"] = "sequence"
        for i, _ in self._present_blocks():
            for lin in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"):
                plan[f"blocks.{i}.{lin}"] = "column"
            for lin in ("attn.out_proj", "mlp.fc_out"):
                plan[f"blocks.{i}.{lin}"] = "row"
            for norm in ("ln_1", "ln_2"):
                plan[f"blocks.{i}.{norm}"] = "sequence"
        return plan

    def parallel_shape(self) -> dict[str, int]:
        hp: Any = self.hparams
        return {"n_layer": hp.n_layer, "n_head": hp.n_head, "vocab_size": hp.vocab_size}

    def selective_checkpointing_modules(self) -> list[str]:
        """Each present block's attention core, ``blocks.<i>.attn.core`` (see :class:`AttentionCore`)."""
        return [f"blocks.{i}.attn.core" for i, _ in self._present_blocks()]

    def context_parallel_plan(self) -> dict[str, Any]:
        """Context parallelism: each block's attention core runs over the cp ranks (:class:`AttentionCore` is
        causal and parameter-free); tokens and labels, ``(b, s)``, are split along dim 1. Positions come from
        ``sequence_positions`` in :class:`Embedding`; the loss, a mean over this rank's counted tokens (labels other
        than -100), is weighed by the rank's share of the counted tokens (``labels``: batch entry 1)."""
        return {"attention": [f"blocks.{i}.attn.core" for i, _ in self._present_blocks()], "batch": {0: 1, 1: 1},
                "labels": 1}

    def full_checkpointing_modules(self) -> list[str]:
        """Each present block, ``blocks.<i>``: a block then keeps only its input for backward. The embedding and
        the head are not recomputed: the embedding keeps only its dropout mask, and recomputing the head would
        repeat its vocabulary-sized matmul to save one hidden-sized tensor."""
        return [f"blocks.{i}" for i, _ in self._present_blocks()]

    # ------------------------------------------------------------------ Lightning
    def forward(self, idx: Tensor) -> Tensor:
        x = idx
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=False)
        return loss

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """The logits of the batch's tokens: a tensor of token ids, or the input of an ``(input, target)`` pair (as
        the training data comes)."""
        return self(batch[0] if isinstance(batch, (list, tuple)) else batch)

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        hp: Any = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr,
            betas=tuple(hp.betas),
        )
        total = self._total_steps()
        warmup, floor = max(0, int(hp.warmup_steps)), float(hp.min_lr_ratio)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _total_steps(self) -> int:
        try:
            steps = int(self.trainer.estimated_stepping_batches)
        except (RuntimeError, AttributeError):
            return 1000
        return steps if 0 < steps < 10**9 else 1000
