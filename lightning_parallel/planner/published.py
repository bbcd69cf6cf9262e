"""Published training throughputs, and the step-time model's prediction of each with the paper's hardware profile.

Each :class:`Published` row is one configuration of a paper or a project's documented benchmark: the model's shape,
the layout, the batch, the precision and recomputation, the machine (a profile of ``configs/hardware``, with the
source's own figures where they differ from it), and the figure it reports. :func:`predict` runs
:func:`lightning_parallel.planner.cost.estimate_step` on it and gives the figure in the paper's unit:

* torchtitan (``docs/performance.md`` of pytorch/torchtitan, Tables 1 and 3): Llama 3.1 8B, FSDP over 8 and 128
  H100 (96 GB HBM2e, 2.4 TB/s, 500 W power limit, 400 Gb/s per GPU between hosts), local batch 2 of 8192 tokens,
  bf16, selective (per-op) activation checkpointing, no ``torch.compile``: tokens/s per GPU;
* Megatron-LM (Narayanan et al., SC'21, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", Table 1): GPT models of 1.7B to 1T parameters on up to 3072 A100-80GB (Selene: DGX A100, 8 x 200
  Gb/s HDR per node), vocabulary 51,200, sequence 2048, mixed precision, full activation recomputation, TP inside a
  node and 1F1B pipelining: teraFLOP/s per GPU as the paper counts them (``96 B s l h^2 (1 + s / 6h + V / 16lh)``,
  recomputation included), divided by the predicted step time.

The paper does not give the micro-batch size of each row: the rows with a pipeline are taken at 1 sequence per
micro-batch (``m = B / (d b)`` micro-batches), those without at the whole local batch (``B / d``) in one step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_parallel.config import ParallelConfig
from lightning_parallel.planner.calibrate import rates_for
from lightning_parallel.planner.cost import estimate_step
from lightning_parallel.planner.flops import KERNELS
from lightning_parallel.planner.hardware import load_profile
from lightning_parallel.planner.model import ModelShape, ModelSpec
from lightning_parallel.planner.settings import MasterWeights, TrainingSettings

__all__ = ["PUBLISHED", "Prediction", "Published", "format_table", "predict", "predict_all"]


@dataclass(frozen=True)
class Published:
    """One published configuration and its reported figure."""

    name: str
    source: str
    shape: ModelShape
    gpus: int
    tp: int
    pp: int
    zero: int
    global_batch: int
    """Sequences per step (the whole world)."""
    seq: int
    recompute: str
    """A policy of :data:`lightning_parallel.planner.cost.RECOMPUTE_PARTS`."""
    profile: str
    kernels: str
    """A key of :data:`lightning_parallel.planner.flops.KERNELS`."""
    figure: float
    unit: str
    """``tokens/s/GPU`` or ``TFLOP/s/GPU``."""
    memory_bandwidth: float | None = None
    """The source's device memory bandwidth (B/s) where it differs from the profile's."""
    setup: str = ""
    master_weights: MasterWeights = "model"
    """Where the run kept its fp32 weights (:attr:`TrainingSettings.master_weights`): torchtitan's FSDP2 steps its
    fp32 shards and gathers bf16 copies (``model``); Megatron-LM holds 16-bit weights and gradients, an fp32 copy in
    its optimizer (``optimizer``)."""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


@dataclass(frozen=True)
class Prediction:
    """A published figure next to the model's."""

    row: Published
    predicted: float
    step_s: float
    mfu: float

    @property
    def ratio(self) -> float:
        """Predicted over published."""
        return self.predicted / self.row.figure


_LLAMA31_8B = ModelShape(n_layer=32, n_embd=4096, n_head=32, n_kv_head=8, ffn_hidden=14336, vocab_size=128256,
                         block_size=8192, bias=False, gated_mlp=True, learned_positions=False)
_TORCHTITAN = "pytorch/torchtitan docs/performance.md"
_MEGATRON = "Narayanan et al. 2021 (SC'21), Table 1"


def _megatron(params: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
              tflops: float) -> Published:
    shape = ModelShape(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=51200, block_size=2048,
                       tie_embeddings=True, dropout=0.1)
    return Published(
        name=f"Megatron-LM GPT {params}", source=_MEGATRON, shape=shape, gpus=gpus, tp=tp, pp=pp, zero=0,
        global_batch=batch, seq=2048, recompute="full", profile="dgx-a100-80gb", kernels="megatron-2021",
        figure=tflops, unit="TFLOP/s/GPU", master_weights="optimizer",
        setup=f"{gpus} A100-80GB, t={tp} p={pp} d={gpus // (tp * pp)}, batch {batch}, full recomputation")


PUBLISHED: tuple[Published, ...] = (
    Published(name="torchtitan Llama 3.1 8B FSDP, 8 GPUs", source=f"{_TORCHTITAN}, Table 1", shape=_LLAMA31_8B,
              gpus=8, tp=1, pp=1, zero=3, global_batch=16, seq=8192, recompute="selective-op", profile="dgx-h100",
              kernels="torch-eager-llama", figure=5762, unit="tokens/s/GPU", memory_bandwidth=2.4e12,
              setup="8 H100 (96 GB, 500 W), FSDP, local batch 2 x 8192, bf16, selective op AC, no compile"),
    Published(name="torchtitan Llama 3.1 8B FSDP, 128 GPUs", source=f"{_TORCHTITAN}, Table 3", shape=_LLAMA31_8B,
              gpus=128, tp=1, pp=1, zero=3, global_batch=256, seq=8192, recompute="selective-op", profile="dgx-h100",
              kernels="torch-eager-llama", figure=5605, unit="tokens/s/GPU", memory_bandwidth=2.4e12,
              setup="128 H100 (16 hosts, 96 GB, 500 W), FSDP, local batch 2 x 8192, bf16, selective op AC"),
    _megatron("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    _megatron("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    _megatron("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _megatron("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _megatron("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _megatron("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _megatron("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _megatron("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _megatron("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)
"""The published configurations ``docs/formulas.md`` tabulates."""


def predict(row: Published) -> Prediction:
    """The model's figure for ``row`` with its paper's hardware profile."""
    hardware = load_profile(row.profile, nodes=max(1, row.gpus // 8))
    rates = rates_for(hardware)
    if row.memory_bandwidth is not None:
        rates = replace(rates, memory_bandwidth=row.memory_bandwidth)
    local = row.global_batch // row.dp
    micro = 1 if row.pp > 1 else local
    m = local // micro if row.pp > 1 else None
    training = TrainingSettings(precision="bf16-mixed", master_weights=row.master_weights, micro_batch_size=micro,
                                seq_len=row.seq,
                                activation_checkpointing="full" if row.recompute == "full" else "selective",
                                num_micro_batches=m)
    layout = ParallelConfig.from_dict({
        "data_parallel_size": row.dp, "tensor_parallel_size": row.tp, "pipeline_parallel_size": row.pp,
        "zero_stage": row.zero, "activation_checkpointing": training.activation_checkpointing,
        **({"num_micro_batches": m} if m else {})})
    cost = estimate_step(ModelSpec.from_shape(row.shape), training, hardware, layout, rates=rates,
                         kernels=KERNELS[row.kernels], recompute=row.recompute)
    if row.unit == "tokens/s/GPU":
        value = cost.tokens / cost.step_s / row.gpus
    else:
        shape, s, b = row.shape, row.seq, row.global_batch
        h, layers, v = shape.n_embd, shape.n_layer, shape.vocab_size
        flops = 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
        value = flops / cost.step_s / row.gpus / 1e12
    return Prediction(row=row, predicted=value, step_s=cost.step_s, mfu=cost.mfu)


def predict_all() -> list[Prediction]:
    return [predict(row) for row in PUBLISHED]


def format_table(predictions: list[Prediction]) -> str:
    """A Markdown table: configuration, setup, published figure, prediction, ratio."""
    lines = ["| configuration | setup | published | predicted | ratio | source |", "|---|---|---:|---:|---:|---|"]
    for p in predictions:
        r = p.row
        lines.append(f"| {r.name} | {r.setup} | {r.figure:,.0f} {r.unit} | {p.predicted:,.0f} | {p.ratio:.2f} | "
                     f"{r.source} |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - python -m lightning_parallel.planner.published
    print(format_table(predict_all()))
