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
Selective recompute drops the ``a s^2 b`` term (attention core recomputed in backward). A fused attention kernel
(SDPA's flash or memory-efficient kernel on GPUs, FlashAttention; this library's GPT runs SDPA) writes no ``s^2``
tensor at all: its core keeps a log-sum-exp per query and head, ``4 a s b`` bytes (fp32), and regenerates its
dropout mask in backward, so ``none`` keeps ``34 s b h + 4 a s b`` (16-bit, with dropout) and ``selective`` saves
only that log-sum-exp (:data:`~lightning_parallel.planner.flops.KERNELS`: Megatron-LM of 2021 had no such kernel).

The paper's model holds 16-bit weights, so its residual stream is 16-bit too. Under Lightning's mixed precision
(autocast over fp32 weights, :meth:`~lightning_parallel.planner.settings.TrainingSettings.autocast_casts`) the
embedding's output is fp32 and so is every block's input and output (the residual adds fp32 and the branches' 16-bit
outputs): the residual stream's elements -- the two LayerNorm inputs, the block's input that full recomputation
keeps, the final LayerNorm's input -- take ``r = 4`` bytes (``residual_bytes``), the rest ``e``. Autocast also casts
a shared input once per linear that reads it (q, k and v: two more ``e s b h``; a gated MLP's two projections: one
more) and keeps a 16-bit copy of every weight matrix a linear used until its backward: ``2 P`` bytes of the stage's
matrices (the head's too; a block's only while it runs when fully recomputed). Without dropout, with a fused
attention kernel: ``(2 r + 14 e + 2 e) s b h + 4 a s b = 40 s b h + 4 a s b`` per layer plus the weight copies,
``4 s b h`` under full recomputation. Under FSDP2 with ``bf16-mixed`` the policy casts each unit's input to bf16
before it runs: the residual stream is 16-bit (``r = 2``: the kept block input, what a stage sends) and no weight is
left to cast, but CUDA's autocast still runs LayerNorm in fp32, keeps that copy of its input (4 bytes) and returns
fp32, which q, k and v cast again (the CPU's runs it in bf16: nothing cast). Measured (the library's GPT, CPU, SDPA
without dropout): within 2 % of this in fp32, under ``bf16-mixed`` and under FSDP2's bf16
(``tests/unit/test_activation_checkpointing.py``).

Context parallelism (``cp``) splits every sequence over ``cp`` ranks: each keeps the activations of ``s / cp``
tokens, so every ``s b h`` term divides by ``cp``; the attention core runs as ring (or all-to-all) attention, which
keeps per layer only a log-sum-exp per query and head (``4 a (s / cp) b / t`` bytes, fp32) and no ``s^2`` tensor
(dropout on attention is refused under cp)::

    context parallel (cp ranks)         (s / cp) b h (10 + 24 / t) + 4 a (s / cp) b / t
                                        (16-bit, no autocast)

The pipeline schedule decides how many micro-batches' activations the first stage holds at once: GPipe ``m``,
1F1B and zero-bubble ``min(p, m)``, interleaved 1F1B ``p + (p - 1) / v`` (the paper's ``1 + (p-1)/(p v)`` factor
on the whole model's activations). Outside the blocks we count the embedding output's dropout mask and the head:
final LayerNorm input (``r s b h``), lm_head input (``e s b h``) and the logits in fp32 for the loss (``4 s b V / t``).
"""

from __future__ import annotations

import math
from fractions import Fraction

from lightning_parallel.config import ParallelConfig
from lightning_parallel.planner.flops import Kernels
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
    flash_attention: bool = False,
    input_casts: int = 0,
    norm_bytes: int | None = None,
    sp_splits_inputs: bool = True,
) -> int:
    """Bytes of activations one transformer layer keeps for backward on one tp rank (Korthikanti Table 2); with
    ``cp > 1`` on one rank of the cp group (``seq_len / cp`` tokens, ring attention: no ``s^2`` term).
    ``residual_bytes``: the residual stream's element (the block's input, the LayerNorms' inputs; None:
    ``element_bytes``) -- 4 under Lightning's autocast, whose fp32 weights keep it fp32. ``flash_attention``: a fused
    attention kernel (SDPA's flash/efficient, FlashAttention) keeps no ``s^2`` tensor, only a log-sum-exp per query
    and head (``4 a s b / t``, fp32; its dropout mask is regenerated from the RNG state), and nothing once the core
    is recomputed (``selective``). ``input_casts``: 16-bit copies, beyond the first, of an input several linears read
    (autocast casts it for each: q, k and v; a gated MLP's two input projections). ``norm_bytes``: the element the
    two LayerNorms keep of their inputs (None: ``residual_bytes``; 4 where CUDA's autocast runs them in fp32 on a
    16-bit residual stream). ``sp_splits_inputs``: sequence parallelism splits the linears' saved inputs too
    (Megatron-LM re-gathers them in backward, the paper's count); False: only the LayerNorm inputs and dropout masks
    are split, the linears keep the all-gathered input (this library's tensor plan)."""
    s, b, h, a, t, e = seq_len, micro_batch_size, hidden, heads, tp, element_bytes
    r = e if residual_bytes is None else residual_bytes
    n = r if norm_bytes is None else norm_bytes
    if cp > 1:
        s_local = Fraction(s, cp)
        if recompute == "full":
            return math.ceil(r * s_local * b * h / (t if sequence_parallel else 1))
        norms, inputs = Fraction(2 * n), Fraction((2 + input_casts) * e)  # no dropout under cp
        per_sbh = _whole_part(norms, inputs, t if sequence_parallel else 1, sp_splits_inputs)
        core = 0 if recompute == "selective" else Fraction(4 * a * s_local * b, t)  # the ring's log-sum-exp
        return math.ceil(s_local * b * h * (per_sbh + Fraction(12 * e, t)) + core)
    masks = 2 if dropout else 0
    if recompute == "full":
        return math.ceil(Fraction(r * s * b * h, t if sequence_parallel else 1))
    if recompute not in ("none", "selective"):
        raise ValueError(f"activation_checkpointing={recompute!r}: use none, selective or full.")
    # 10 in the paper (4 e + 2): left whole by TP, split by sequence parallelism
    norms, inputs = Fraction(2 * n + masks), Fraction((2 + input_casts) * e)
    split = 12 * e  # 24 in the paper
    sbh = Fraction(s * b * h)
    per_sbh = _whole_part(norms, inputs, t if sequence_parallel else 1, sp_splits_inputs)
    if flash_attention:
        core = Fraction(0) if recompute == "selective" else Fraction(4 * a * s * b, t)  # the log-sum-exp
    else:
        attention_core = 0 if recompute == "selective" else (2 * e + 1 if dropout else e)  # 5 in the paper
        core = Fraction(attention_core * a * s * s * b, t)
    return math.ceil(sbh * (per_sbh + Fraction(split, t)) + core)


def _whole_part(norms: Fraction, inputs: Fraction, sp: int, splits_inputs: bool) -> Fraction:
    """Bytes per ``s b h`` of what tensor parallelism leaves whole: the LayerNorm inputs and dropout masks (``norms``,
    split over ``sp`` ranks by sequence parallelism) and the linears' inputs (``inputs``, split too when the
    implementation re-gathers them in backward)."""
    return norms / sp + (inputs / sp if splits_inputs else inputs)


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


def activation_bytes(model: ModelSpec, training: TrainingSettings, layout: ParallelConfig, *,
                     kernels: Kernels | None = None, gpu: bool = True) -> int:
    """Peak activation bytes on the busiest device: the first stage's blocks and embedding, or the head.
    ``kernels``: the implementation's (:data:`~lightning_parallel.planner.flops.KERNELS`; default this library's GPT,
    whose SDPA is a fused attention kernel on GPUs). ``gpu``: CUDA's autocast runs LayerNorm in fp32 and keeps that
    copy of a 16-bit input (FSDP2's bf16 units); the CPU's keeps the 16-bit input."""
    shape = model.shape
    if shape is None:
        raise ValueError("activation memory needs the model's shape (layers, hidden size, heads).")
    pp, tp, cp = layout.pipeline_parallel_size, layout.tensor_parallel_size, layout.context_parallel_size
    s, b, h = training.sequence_length(shape.block_size), training.micro_batch_size, shape.n_embd
    e, dropout = training.activation_bytes, shape.dropout > 0 and cp == 1
    offload, fsdp = layout.offload_device, layout.runs_fsdp2
    r, casts = training.residual_bytes(offload=offload, fsdp=fsdp), training.autocast_casts(offload=offload, fsdp=fsdp)
    norm = training.norm_bytes(offload=offload, fsdp=fsdp, gpu=gpu)
    recompute = layout.activation_checkpointing
    kernels = kernels or Kernels()
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
        flash_attention=kernels.flash_attention,
        # each linear casts its fp32 input once more (fp32: the residual stream under autocast, or CUDA's LayerNorm)
        input_casts=(2 + (1 if shape.gated_mlp else 0)) if casts or norm > e else 0,
        norm_bytes=norm,
        sp_splits_inputs=kernels.sp_splits_inputs,
    )
    if casts and recompute != "full":  # autocast's 16-bit copies of the layer's weight matrices, saved for backward
        # by every micro-batch's forward (Lightning's autocast runs without its cast cache); a fully recomputed block
        # casts them again in its recomputation instead
        per_layer += 2 * shape.block_matrix_params(tp)
    in_flight = micro_batches_in_flight(layout, training.micro_batches(pp))
    layers = math.ceil(shape.n_layer / pp)
    local = Fraction(s, cp)  # tokens per rank
    embedding = Fraction(local * b * h, tp if layout.sequence_parallel else 1) if dropout else Fraction(0)
    head = Fraction((norm + e) * local * b * h) + Fraction(4 * local * b * shape.vocab_size, tp)
    head_cast = Fraction(2 * shape.vocab_size * h, tp) if casts else Fraction(0)  # the head's weight, 16-bit
    first = (layers * per_layer + embedding) * in_flight
    if pp == 1:
        return math.ceil(first + head + head_cast)
    # the last stage: one micro-batch at a time under 1F1B (its backward follows its forward), all m under GPipe
    last_in_flight = training.micro_batches(pp) if layout.pipeline_schedule == "gpipe" else 1
    return math.ceil(max(first, (layers * per_layer + head + head_cast) * last_in_flight))
