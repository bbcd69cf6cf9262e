"""The planner with context parallelism: activation memory divided by cp, the ring's traffic on the cp axis, the
replicas' exchange over dp x cp, the guide's sequence branch, and lp_auto choosing cp for a long sequence."""

from __future__ import annotations

import torch

from lightning_parallel.auto import plan_for_module
from lightning_parallel.config import ParallelConfig
from lightning_parallel.models import GPT
from lightning_parallel.planner import ModelSpec, TrainingSettings, make_hardware
from lightning_parallel.planner.activations import activation_bytes, layer_activation_bytes
from lightning_parallel.planner.cost import axis_bytes_per_rank, axis_links
from lightning_parallel.planner.memory import estimate_memory
from lightning_parallel.planner.model import ModelShape

SHAPE = ModelShape(n_layer=4, n_embd=128, n_head=4, vocab_size=256, block_size=4096, dropout=0.0)
FP32 = TrainingSettings(precision="fp32", micro_batch_size=1, seq_len=4096, activation_checkpointing="none")


def test_activation_bytes_divide_by_cp() -> None:
    s, b, h, a, e = 4096, 1, 128, 4, 4
    for cp in (2, 4, 8):
        per_layer = layer_activation_bytes(seq_len=s, micro_batch_size=b, hidden=h, heads=a, element_bytes=e,
                                           dropout=False, cp=cp)
        # (s/cp) b h (4e + 12e) + the ring's log-sum-exp 4 a (s/cp) b: linear in the rank's tokens
        assert per_layer == (s // cp) * b * h * 16 * e + 4 * a * (s // cp) * b
        # with tp = 2: the split part / 2, the log-sum-exp of half the heads
        assert layer_activation_bytes(seq_len=s, micro_batch_size=b, hidden=h, heads=a, element_bytes=e,
                                      dropout=False, cp=cp, tp=2) == (s // cp) * b * h * (4 * e + 6 * e) + \
            2 * a * (s // cp) * b
    spec = ModelSpec.from_shape(SHAPE)
    totals = {cp: activation_bytes(spec, FP32, ParallelConfig(data_parallel_size=1, context_parallel_size=cp))
              for cp in (2, 4, 8)}
    assert totals[2] == 2 * totals[4] == 4 * totals[8]


def test_ring_traffic_on_the_cp_axis_and_replicas_over_dp_x_cp() -> None:
    spec = ModelSpec.from_shape(SHAPE)
    hw = make_hardware(gpus_per_node=8, gpu_memory="80GB")
    layout = ParallelConfig(data_parallel_size=2, context_parallel_size=4)
    traffic = axis_bytes_per_rank(spec, FP32, layout, hw)
    block = 2 * 1 * (4096 / 4) * 128  # k and v of this rank's tokens, elements
    assert traffic["cp"] == SHAPE.n_layer * (2 * 3 * 4 + 4 * 4) * block  # 3 hops each way (fp32), 4 dk/dv hops
    psi = spec.params_per_device(pp=1, tp=1)
    assert traffic["dp"] == 2 * 4 * psi * 7 / 8  # the all-reduce over the 8 replicas (dp 2 x cp 4)
    assert axis_links(layout, hw)["cp"].startswith("intra-node")
    # ZeRO-3 shards the model states over dp x cp: 1/8 of them per rank
    z3 = estimate_memory(spec, FP32, hw, layout.replace(zero_stage=3))
    z0 = estimate_memory(spec, FP32, hw, layout)
    assert abs(z3.model_states * 8 - z0.model_states) <= 8 * 16


def _long_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(n_layer=4, n_head=4, n_embd=128, block_size=4096, vocab_size=256, dropout=0.0)


def _decide(budget: str, devices: int = 4) -> object:
    return plan_for_module(_long_gpt(), accelerator="cpu", devices=devices, precision="32-true", micro_batch_size=1,
                           seq_len=4096, options={"gpu_memory": budget, "select": "guide"})


def test_lp_auto_picks_cp_when_the_sequence_does_not_fit() -> None:
    """A 4096-token sequence on 4 CPU ranks: one device needs 181.5 MB, nearly all activations (64 s b h + 4 a s b
    per layer in fp32: SDPA's fused kernel keeps no s^2 tensor) while its model states are 22 MB. Where splitting the
    sequence over cp ranks fits the budget, the sequence branch opens and the smallest such cp is chosen, without
    recomputation (cp = 2 needs 103 MB, 94 MB with ZeRO; at 80 MB tp = 2 x cp = 2, 57 MB, is ranked first in the cp
    family by the step-time model with the default rates); where no cp split fits, the guide's other branches decide
    with recomputation, as before; where one device fits, nothing changes."""
    expected = {"150MB": ("one-node/sequence-does-not-fit", 2, "none", "lp_ddp"),
                "100MB": ("one-node/sequence-does-not-fit", 2, "none", "lp_sharded"),
                "80MB": ("one-node/sequence-does-not-fit", 2, "none", "lp_tensor"),
                "60MB": ("one-node/fits", 1, "full", "lp_ddp"),
                "4GB": ("one-node/fits", 1, "none", "lp_ddp")}
    for budget, (branch, cp, recompute, strategy) in expected.items():
        decision = _decide(budget)
        layout = decision.layout  # type: ignore[attr-defined]
        got = (decision.plan.branch, layout.context_parallel_size, layout.activation_checkpointing)  # type: ignore
        assert got == (branch, cp, recompute), budget
        assert decision.strategy_name == strategy  # type: ignore[attr-defined]
        assert decision.chosen.memory.total <= decision.plan.hardware.gpu_memory  # type: ignore[attr-defined]
        if cp > 1:
            assert "context parallelism" in decision.plan.reason  # type: ignore[attr-defined]
            assert f"cp={cp}" in decision.text()  # type: ignore[attr-defined]
