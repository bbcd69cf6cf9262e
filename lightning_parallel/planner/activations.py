"""Activation memory of a GPT, after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (Sec. 4, Table 2).

Per transformer layer, sequence ``s``, micro-batch ``b``, hidden ``h``, heads ``a``, tensor-parallel degree ``t``,
16-bit activations with dropout (the paper's setting), in bytes::

    no parallelism                      s b h (34 + 5 a s / h)
    tensor parallel                     s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallel          s b h / t (34 + 5 a s / h)
    tensor parallel + selective recompute                  s b h (10 + 24 / t)
    tensor + sequence parallel + selective recompute       34 s b h / t
    full recompute                      2 s b h  (the block's input only; / t with sequence parallel)

Where the numbers come from, for an element size ``e`` (2 bytes in 16 bits, 4 in fp32) and 1-byte dropout masks:
``34 = 16 e + 2`` (attention 11: QKV input, Q, K, V, projection input, mask; MLP 19: input, GeLU input and output
(4h wide), mask; two LayerNorm inputs 4) and ``5 = 2 e + 1`` (softmax output, its dropout mask, dropout output,
each a s^2 b). Without dropout the masks vanish: ``16 e`` and ``e``. The part that TP leaves whole is
``4 e + 2`` (= 10: LayerNorm inputs, masks, the QKV and MLP inputs); sequence parallelism splits it too.
Selective recompute drops the ``a s^2 b`` term (attention core recomputed in backward).

The paper's model holds 16-bit weights, so its residual stream is 16-bit too. Under Lightning's mixed precision
(autocast over fp32 weights) the embedding's output is fp32 and so is every block's input and output (the residual
adds fp32 and the branches' 16-bit outputs): the residual stream's elements -- the two LayerNorm inputs, the block's
input that full recomputation keeps, the final LayerNorm's input -- take ``r = 4`` bytes
(:meth:`~lightning_parallel.planner.settings.TrainingSettings.residual_bytes`), the rest ``e``: ``2 r + 14 e + 2``
per ``s b h`` (36 in place of 34), ``r s b h`` under full recomputation (measured: a block of the library's GPT keeps
exactly ``4 s b h`` under ``bf16-mixed``, as in fp32).

Context parallelism (``cp``) splits every sequence over ``cp`` ranks: each keeps the activations of ``s / cp``
tokens, so every ``s b h`` term divides by ``cp``; the attention core runs as ring (or all-to-all) attention, which
keeps per layer only a log-sum-exp per query and head (``4 a (s / cp) b / t`` bytes, fp32) and no ``s^2`` tensor
(dropout on attention is refused under cp)::

    context parallel (cp ranks)         (s / cp) b h (10 + 24 / t) + 4 a (s / cp) b / t   (+ SP: the 10 / t too)

The pipeline schedule decides how many micro-batches' activations the first stage holds at once: GPipe ``m``,
1F1B and zero-bubble ``min(p, m)``, interleaved 1F1B ``p + (p - 1) / v`` (the paper's ``1 + (p-1)/(p v)`` factor
on the whole model's activations). Outside the blocks we count the embedding output's dropout mask and the head:
final LayerNorm input (``r s b h``), lm_head input (``e s b h``) and the logits in fp32 for the loss (``4 s b V / t``).
"""

from __future__ import annotations

import math
from fractions import Fraction

from lightning_parallel.config import ParallelConfig
from lightning_parallel.planner.model import ModelSpec
from lightning_parallel.planner.settings import TrainingSettings

__all__ = ["activation_bytes", "layer_activation_bytes", "micro_batches_in_flight"]


def layer_activation_bytes(
    *,
    seq_len: int,
    micro_batch_size: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    element_bytes: int = 2,
    dropout: bool = True,
    cp: int = 1,
    residual_bytes: int | None = None,
) -> int:
    """Bytes of activations one transformer layer keeps for backward on one tp rank (Korthikanti Table 2); with
    ``cp > 1`` on one rank of the cp group (``seq_len / cp`` tokens, ring attention: no ``s^2`` term).
    ``residual_bytes``: the residual stream's element (the block's input, the LayerNorms' inputs; None:
    ``element_bytes``) -- 4 under Lightning's autocast, whose fp32 weights keep it fp32."""
    s, b, h, a, t, e = seq_len, micro_batch_size, hidden, heads, tp, element_bytes
    r = e if residual_bytes is None else residual_bytes
    if cp > 1:
        s_local = Fraction(s, cp)
        if recompute == "full":
            return math.ceil(r * s_local * b * h / (t if sequence_parallel else 1))
        whole = 2 * r + 2 * e  # no dropout under cp
        per_sbh = Fraction(whole, t) if sequence_parallel else Fraction(whole)
        core = 0 if recompute == "selective" else Fraction(4 * a * s_local * b, t)  # the ring's log-sum-exp
        return math.ceil(s_local * b * h * (per_sbh + Fraction(12 * e, t)) + core)
    masks = 2 if dropout else 0
    if recompute == "full":
        return math.ceil(Fraction(r * s * b * h, t if sequence_parallel else 1))
    if recompute not in ("none", "selective"):
        raise ValueError(f"activation_checkpointing={recompute!r}: use none, selective or full.")
    whole = 2 * r + 2 * e + masks  # 10 in the paper: left whole by TP, split by sequence parallelism
    split = 12 * e  # 24 in the paper
    attention_core = 0 if recompute == "selective" else (2 * e + 1 if dropout else e)  # 5 in the paper
    sbh = Fraction(s * b * h)
    per_sbh = Fraction(whole, t) if sequence_parallel else Fraction(whole)
    total = sbh * (per_sbh + Fraction(split, t)) + Fraction(attention_core * a * s * s * b, t)
    return math.ceil(total)


def micro_batches_in_flight(layout: ParallelConfig, micro_batches: int) -> Fraction:
    """Micro-batches whose activations the first pipeline stage holds at its peak."""
    p, v = layout.pipeline_parallel_size, layout.virtual_pipeline_stages
    if p == 1:
        return Fraction(1)
    if layout.pipeline_schedule == "gpipe":
        return Fraction(micro_batches)
    if layout.pipeline_schedule == "interleaved_1f1b":
        return Fraction(p) + Fraction(p - 1, v)
    return Fraction(min(p, micro_batches))


def activation_bytes(model: ModelSpec, training: TrainingSettings, layout: ParallelConfig) -> int:
    """Peak activation bytes on the busiest device: the first stage's blocks and embedding, or the head."""
    shape = model.shape
    if shape is None:
        raise ValueError("activation memory needs the model's shape (layers, hidden size, heads).")
    pp, tp, cp = layout.pipeline_parallel_size, layout.tensor_parallel_size, layout.context_parallel_size
    s, b, h = training.sequence_length(shape.block_size), training.micro_batch_size, shape.n_embd
    e, dropout = training.activation_bytes, shape.dropout > 0 and cp == 1
    r = training.residual_bytes(offload=layout.offload_device)
    per_layer = layer_activation_bytes(
        seq_len=s,
        micro_batch_size=b,
        hidden=h,
        heads=shape.n_head,
        tp=tp,
        sequence_parallel=layout.sequence_parallel,
        recompute=layout.activation_checkpointing,
        element_bytes=e,
        dropout=dropout,
        cp=cp,
        residual_bytes=r,
    )
    in_flight = micro_batches_in_flight(layout, training.micro_batches(pp))
    layers = math.ceil(shape.n_layer / pp)
    local = Fraction(s, cp)  # tokens per rank
    embedding = Fraction(local * b * h, tp if layout.sequence_parallel else 1) if dropout else Fraction(0)
    head = Fraction((r + e) * local * b * h) + Fraction(4 * local * b * shape.vocab_size, tp)
    first = (layers * per_layer + embedding) * in_flight
    if pp == 1:
        return math.ceil(first + head)
    return math.ceil(max(first, layers * per_layer + head))
