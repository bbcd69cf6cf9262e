"""Work of one transformer layer from its shape: the GEMMs, the attention core and the memory-bound rest.

Per micro-batch of ``T = b s`` tokens on one tensor-parallel rank (``t`` ranks), with hidden ``h``, key/value width
``h_kv`` (``h`` without grouped-query attention), MLP width ``f`` (``4 h``; SwiGLU has two input matrices), the
forward GEMMs of one layer are (``m x k`` by ``k x n``, 2 m n k FLOPs each)::

    qkv  T x h   by  h x (h + 2 h_kv) / t
    out  T x h/t by  h/t x h
    in   T x h   by  h x f / t          (twice under SwiGLU: gate and up)
    down T x f/t by  f/t x h

the attention core ``2 x 2 b s^2 h / t`` FLOPs (scores and their product with the values, counted whole as Megatron
and torchtitan count them), and the logits ``2 T h V / t`` on the last stage. Backward is twice the forward.
Recomputation adds the forward of every GEMM and the core (``full``) or of the attention core only (``selective``,
Korthikanti et al. 2022).

The memory-bound rest of a layer moves, per token in forward (twice that in backward), at the device's memory
bandwidth (:class:`Kernels` says which kernels the implementation runs; ``e`` bytes per activation element)::

    norms      2 x 2 e h (one fused LayerNorm kernel: read, write), or 2 x 36 h (eager RMSNorm: fp32 upcast, square,
               mean, scale, cast back, weight: ~9 passes)
    residuals  2 x 3 e h (read two, write one)
    qkv heads  3 e (h + 2 h_kv) / t (the heads' layout for the attention kernel)
    rotary     20 (h + h_kv) / t (eager rotary embedding of q and k: complex view in fp32, multiply, cast back)
    MLP        2 e f / t (GELU) or 5 e f / t (SwiGLU: the gate's SiLU and the product)
    scores     6 e a s / t (attention without a fused kernel: scores written, softmax read and written, read by the
               product with the values), plus dropout's read, write and 1-byte mask on them
    dropout    2 x (2 e + 1) h on the hidden states when the model has dropout

:func:`model_flops_per_token` is the "model FLOPs" MFU counts: forward + backward, no recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_parallel.planner.model import ModelShape

__all__ = ["KERNELS", "Kernels", "LayerWork", "elementwise_bytes_per_token", "head_work", "layer_work",
           "model_flops_per_token"]


@dataclass(frozen=True)
class Kernels:
    """What an implementation's memory-bound ops look like (see the module docstring)."""

    fused_norm: bool = True
    """LayerNorm as one kernel (torch ``layer_norm``, Apex/Megatron); False: an eager RMSNorm of several kernels."""
    flash_attention: bool = True
    """A fused attention kernel (SDPA flash/efficient, FlashAttention): no scores in memory."""
    rotary: bool = False
    """An eager rotary embedding on q and k."""
    sp_splits_inputs: bool = False
    """Under sequence parallelism the linears keep their inputs split over tp and all-gather them again in backward
    (Megatron-LM); False: they keep the all-gathered input (this library's tensor plan, DTensor's)."""


KERNELS: dict[str, Kernels] = {
    "lightning-parallel": Kernels(),
    "megatron-2021": Kernels(fused_norm=True, flash_attention=False, sp_splits_inputs=True),
    "torch-eager-llama": Kernels(fused_norm=False, flash_attention=True, rotary=True),
}
"""The implementations the planner knows: this library's GPT (torch ``layer_norm`` and SDPA), Megatron-LM as of
Narayanan et al. 2021 (fused LayerNorm and softmax, attention scores in memory), an eager torch Llama (torchtitan
without ``torch.compile``: RMSNorm and rotary embedding as separate kernels, SDPA)."""


def elementwise_bytes_per_token(shape: ModelShape, *, seq: int, tp: int = 1, element_bytes: int = 2,
                                kernels: Kernels | None = None) -> float:
    """Bytes a layer's memory-bound forward ops move per token on one tp rank (the module docstring's table)."""
    k = kernels or Kernels()
    e, h, kv, f = element_bytes, shape.n_embd, shape.kv_dim, shape.ffn_dim
    total = (2 * 2 * e * h if k.fused_norm else 2 * 36 * h) + 2 * 3 * e * h + 3 * e * (h + 2 * kv) / tp
    total += (5 if shape.gated_mlp else 2) * e * f / tp
    if k.rotary:
        total += 20 * (h + kv) / tp
    if not k.flash_attention:
        total += (6 * e + (2 * e + 1 if shape.dropout > 0 else 0)) * shape.n_head * seq / tp
    if shape.dropout > 0:
        total += 2 * (2 * e + 1) * h
    return float(total)


@dataclass(frozen=True)
class LayerWork:
    """One layer's forward on one micro-batch and tp rank: its GEMMs ``(m, n, k)``, the attention core's FLOPs, and
    the bytes its memory-bound ops move."""

    gemms: tuple[tuple[int, int, int], ...]
    attention_flops: float
    elementwise_bytes: float

    @property
    def gemm_flops(self) -> float:
        return float(sum(2 * m * n * k for m, n, k in self.gemms))


def layer_work(shape: ModelShape, *, batch: int, seq: int, tp: int = 1, element_bytes: int = 2,
               cp: int = 1, kernels: Kernels | None = None) -> LayerWork:
    """The forward work of one layer for ``batch`` sequences of ``seq`` tokens (``seq / cp`` on each cp rank)."""
    h, kv, f = shape.n_embd, shape.kv_dim, shape.ffn_dim
    tokens = batch * seq // cp
    gemms = [(tokens, (h + 2 * kv) // tp, h), (tokens, h, h // tp), (tokens, f // tp, h), (tokens, h, f // tp)]
    if shape.gated_mlp:
        gemms.append((tokens, f // tp, h))
    attention = 4.0 * batch * (seq / cp) * seq * h / tp  # each cp rank's queries against the whole sequence
    per_token = elementwise_bytes_per_token(shape, seq=seq, tp=tp, element_bytes=element_bytes, kernels=kernels)
    return LayerWork(gemms=tuple(gemms), attention_flops=attention, elementwise_bytes=per_token * tokens)


def head_work(shape: ModelShape, *, batch: int, seq: int, tp: int = 1, cp: int = 1) -> tuple[int, int, int]:
    """The logits GEMM ``(T, V / t, h)`` of the last stage."""
    return (batch * seq // cp, shape.vocab_size // tp, shape.n_embd)


def model_flops_per_token(shape: ModelShape, *, seq: int) -> float:
    """Forward + backward FLOPs per token of the whole model, no recomputation (what MFU counts): 3 x (2 x the
    matrices' parameters + 4 s h per layer for attention + 2 h V for the logits)."""
    work = layer_work(shape, batch=1, seq=seq)
    per_layer = work.gemm_flops / seq + work.attention_flops / seq
    return 3.0 * (shape.n_layer * per_layer + 2.0 * shape.n_embd * shape.vocab_size)
