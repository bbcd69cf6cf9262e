"""The reference GPT: a pre-LN decoder-only transformer as a LightningModule, ready for PP and TP.

Structure (what the parallel strategies rely on):

* ``pipeline_layers()`` returns the model as an ordered sequence ``[embedding, block_0, ..., block_{L-1}, head]``;
  each element maps one tensor to one tensor (token ids -> hidden -> ... -> logits), so a pipeline can cut the
  sequence anywhere; ``pipeline_loss(logits, targets)`` is the loss on the last stage's output.
* ``tensor_parallel_plan()`` names how each linear splits for Megatron-style tensor parallelism: q/k/v and the MLP's
  first linear column-parallel (output features sharded over ``tp``), the attention output and the MLP's second
  linear row-parallel (input features sharded, one all-reduce in forward), the embedding and head vocab-parallel.

Optimizer: AdamW (weight decay on matrices only) with linear warmup then cosine decay to ``min_lr_ratio * lr``.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.module import ParallelModuleMixin

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "Embedding", "Head"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate ``q_proj``/``k_proj``/``v_proj`` and ``out_proj``.

    Under TP the heads are split over ``tp``: q/k/v are column-parallel (each rank computes ``n_head / tp`` heads),
    ``out_proj`` is row-parallel (partial sums all-reduced over ``tp`` in forward; identity in backward).
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
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        # -1 heads: under TP each rank holds n_head / tp heads, inferred from the (sharded) projection width.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, -1)
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
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.block_size}.")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection ``lm_head`` (vocab-parallel under TP)."""

    def __init__(self, n_embd: int, vocab_size: int, bias: bool) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(ParallelModuleMixin, pl.LightningModule):
    """A GPT language model (pre-LN decoder) trained with next-token cross-entropy.

    Args:
        n_layer: transformer blocks. n_head: attention heads. n_embd: hidden size (divisible by n_head).
        block_size: maximum sequence length. vocab_size: tokens (256 for byte-level text).
        dropout: dropout probability (0 keeps training deterministic). bias: biases in linears and LayerNorms.
        tie_embeddings: share the token embedding with ``lm_head`` (off by default: a tied weight spans the first
            and last pipeline stage).
        lr, weight_decay, betas: AdamW. warmup_steps: linear warmup. min_lr_ratio: cosine floor as a fraction of lr.
    """

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
        self.embed = Embedding(vocab_size, block_size, n_embd, dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.head = Head(n_embd, vocab_size, bias)
        if tie_embeddings:
            self.head.lm_head.weight = self.embed.tok.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith(("out_proj.weight", "fc_out.weight")):  # GPT-2 scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

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
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output.reshape(-1, output.size(-1)).float(), target.reshape(-1))

    def tensor_parallel_plan(self) -> dict[str, str]:
        plan = {"embed.tok": "vocab", "head.lm_head": "vocab"}
        for i in range(len(self.blocks)):
            for lin in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"):
                plan[f"blocks.{i}.{lin}"] = "column"
            for lin in ("attn.out_proj", "mlp.fc_out"):
                plan[f"blocks.{i}.{lin}"] = "row"
        return plan

    def parallel_shape(self) -> dict[str, int]:
        hp: Any = self.hparams
        return {"n_layer": len(self.blocks), "n_head": hp.n_head, "vocab_size": hp.vocab_size}

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
