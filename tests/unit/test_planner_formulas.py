"""The planner's formulas pinned to published figures; each expected number cites its source."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_parallel.config import ParallelConfig
from lightning_parallel.planner import (
    Hardware,
    ModelShape,
    ModelSpec,
    TrainingSettings,
    estimate_memory,
    layer_activation_bytes,
    model_states,
    model_states_bytes,
    parse_bytes,
    parse_count,
)
from lightning_parallel.planner.activations import activation_bytes

MIXED_ADAM = TrainingSettings(master_weights="optimizer").state_bytes  # 2 + 2 + 12, the ZeRO paper's K = 12
GIB = 2**30


# --------------------------------------------------------------------------- ZeRO paper
# Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", Figure 1
# (Psi = 7.5B, N_d = 64, K = 12): baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB.
def test_zero_paper_figure_1() -> None:
    got = model_states_bytes(7_500_000_000, MIXED_ADAM, dp=64)
    assert got["ddp"] == 120_000_000_000
    assert round(got["zero1"] / 1e9, 1) == 31.4
    assert round(got["zero2"] / 1e9, 1) == 16.6
    assert round(got["zero3"] / 1e9, 1) == 1.9
    assert all(isinstance(v, int) for v in got.values())


# ZeRO paper, Table 1: per-device memory (GB) of the 7.5B model for N_d = 1 ... 1024, stages 1/2/3.
@pytest.mark.parametrize(
    ("dp", "zero1", "zero2", "zero3"),
    [(1, 120, 120, 120), (4, 52.5, 41.3, 30), (16, 35.6, 21.6, 7.5), (64, 31.4, 16.6, 1.88),
     (256, 30.4, 15.4, 0.47), (1024, 30.1, 15.1, 0.12)],
)
def test_zero_paper_table_1_7_5b(dp: int, zero1: float, zero2: float, zero3: float) -> None:
    got = model_states_bytes(7_500_000_000, MIXED_ADAM, dp=dp)
    tolerance = 0.0051 if zero3 < 2 else 0.051  # the paper prints 1-3 significant digits
    assert got["zero1"] / 1e9 == pytest.approx(zero1, abs=0.051)
    assert got["zero2"] / 1e9 == pytest.approx(zero2, abs=0.051)
    assert got["zero3"] / 1e9 == pytest.approx(zero3, abs=tolerance)


# ZeRO paper, Table 1: a 1T-parameter model with ZeRO-3 over 1024 devices needs 15.6 GB per device.
def test_zero_paper_trillion_parameters() -> None:
    assert round(model_states_bytes(10**12, MIXED_ADAM, dp=1024)["zero3"] / 1e9, 1) == 15.6


def _pgk(state: Any) -> tuple[int, int, int]:
    return state.param, state.grad, state.optimizer


def test_fp32_adam_is_4_4_8_and_sgd_variants() -> None:
    assert _pgk(TrainingSettings(precision="fp32").state_bytes) == (4, 4, 8)
    lightning_name: Any = "32-true"  # Lightning's spelling is accepted too
    assert TrainingSettings(precision=lightning_name, optimizer="sgd").state_bytes.total == 8
    master = TrainingSettings(master_weights="optimizer", optimizer="sgd-momentum")
    assert master.state_bytes.optimizer == 8  # master 4 + momentum 4
    assert TrainingSettings(master_weights="optimizer", optimizer="sgd").state_bytes.optimizer == 4  # the master only
    assert TrainingSettings(optimizer="sgd-momentum").state_bytes.optimizer == 4  # fp32 weights are the model's


def test_lightning_mixed_precision_keeps_fp32_weights_and_gradients() -> None:
    # Lightning's bf16-mixed/16-mixed: autocast over fp32 parameters, so DDP and the flat ZeRO-1/2 keep fp32 weights
    # and gradients and reduce in fp32, the optimizer only its moments (measured per rank under bf16-mixed:
    # tests/trainer/test_precision.py); FSDP2 under bf16-mixed gathers bf16 copies of its fp32 shards (16-mixed: no
    # MixedPrecisionPolicy, fp32); the offload engine (DeepSpeed) keeps 16-bit weights and an fp32 master.
    bf16, fp16 = TrainingSettings(), TrainingSettings(precision="fp16-mixed")
    assert _pgk(bf16.state_bytes) == (4, 4, 8) and (bf16.state_bytes.gathered, bf16.state_bytes.reduced) == (4, 4)
    assert bf16.state_bytes_for(fsdp=True).gathered == 2 and bf16.state_bytes_for(fsdp=True).reduced == 4
    assert fp16.state_bytes_for(fsdp=True).gathered == 4
    assert _pgk(bf16.state_bytes_for(offload="cpu")) == (2, 2, 12)
    psi, n = 8_000_000, 8
    got = model_states_bytes(psi, bf16.state_bytes, dp=n)
    assert got == {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi // n, "zero2": 4 * psi + 12 * psi // n,
                   "zero3": 16 * psi // n}
    paper = model_states_bytes(psi, MIXED_ADAM, dp=n)  # what 16-bit weights with a master in the optimizer need
    assert got["zero1"] - paper["zero1"] == 4 * psi * (n - 1) // n and got["zero2"] - paper["zero2"] == 2 * psi * (
        n - 1) // n
    # FSDP2 keeping its gathered weights through a pipeline step (ZeRO-2): bf16 copies beside the fp32 shards
    fsdp = bf16.state_bytes_for(fsdp=True)
    kept = model_states(psi, fsdp, dp=n, zero_stage=2, pipeline=True, reshard=False)
    assert kept.params == 2 * psi + 4 * psi // n and kept.grads == 4 * psi and kept.optimizer == 8 * psi // n
    layouts = {"zero1": ParallelConfig(data_parallel_size=n, zero_stage=1),
               "zero3": ParallelConfig(data_parallel_size=n, zero_stage=3),
               "offload": _dp8(2, "cpu")}
    mem = {k: estimate_memory(ModelSpec.from_params(psi), bf16, _plain_hardware(), v) for k, v in layouts.items()}
    assert (mem["zero1"].params, mem["zero1"].grads, mem["zero1"].optimizer) == (4 * psi, 4 * psi, 8 * psi // n)
    assert mem["zero3"].model_states == 16 * psi // n
    assert (mem["offload"].params, mem["offload"].host_per_node) == (2 * psi, round(16 * psi * 1.1))


def test_shards_round_up_to_whole_elements() -> None:
    states = model_states(10, MIXED_ADAM, dp=3, zero_stage=3)
    assert (states.params, states.grads, states.optimizer) == (2 * 4, 2 * 4, 12 * 4)  # ceil(10 / 3) = 4


# --------------------------------------------------------------------------- DeepSpeed's estimator
# deepspeed/runtime/zero/stage3.py estimate_zero3_model_states_mem_needs and stage_1_and_2.py
# estimate_zero2_model_states_mem_needs, as printed in DeepSpeed's docs ("Memory Requirements") for t5-3b
# (2,851,598,336 parameters, largest layer 32,899,072 = the 32128 x 1024 shared embedding), 1 node x 8 GPUs:
#   ZeRO-3 offload_param=cpu, offload_optimizer=cpu: per GPU 0.12 GB, per CPU 71.71 GB (buffer factor 1.5)
#   ZeRO-3 offload_optimizer=cpu only:              per GPU 0.79 GB, per CPU 63.74 GB
#   ZeRO-2 offload_optimizer=cpu:                   per GPU 5.31 GB
# ("GB" there is GiB: DeepSpeed divides by 2**30.)
T5_3B, T5_3B_LARGEST = 2_851_598_336, 32_899_072


def _plain_hardware() -> Hardware:
    return Hardware(gpus_per_node=8, gpu_memory=80 * GIB, reserved_memory=0, cpu_memory_per_node=10**13)


def _dp8(zero: int, offload: str) -> ParallelConfig:
    return ParallelConfig(data_parallel_size=8, zero_stage=zero, offload=offload)  # type: ignore[arg-type]


def test_deepspeed_zero3_offload_params_and_optimizer() -> None:
    model = ModelSpec.from_params(T5_3B, largest_layer_params=T5_3B_LARGEST)
    mem = estimate_memory(model, TrainingSettings(), _plain_hardware(), _dp8(3, "cpu"))
    assert mem.model_states == 0
    assert round(mem.buffers / GIB, 2) == 0.12  # = 4 x largest layer, DeepSpeed's gpu_mem
    host = model_states(T5_3B, MIXED_ADAM, dp=8, zero_stage=3, offload="cpu").host * 8
    assert round(host * 1.5 / GIB, 2) == 71.71  # 18 bytes per parameter over the node, x DeepSpeed's 1.5


def test_deepspeed_zero3_offload_optimizer_only_host_bytes() -> None:
    host = model_states(T5_3B, MIXED_ADAM, dp=8, zero_stage=2, offload="cpu").host * 8
    assert round(host * 1.5 / GIB, 2) == 63.74  # 16 bytes per parameter, x 1.5


def test_fp32_offload_host_keeps_its_own_fp32_partition() -> None:
    # fp32 AdamW at stage 2: the device keeps the model's fp32 weights, the host the moments (8), the fp32 gradient
    # partition (4) and its own fp32 copy of the partition (4); at stage 3 the offloaded weight partition is that
    # copy. DeepSpeed's CPU offload measured 16 bytes per partition element on the host at both stages
    # (benchmarks/bench.py, case offload; lp_auto's run summary at ZeRO-3).
    fp32 = TrainingSettings(precision="fp32").state_bytes
    n, dp = 1_000_000, 2
    z2 = model_states(n, fp32, dp=dp, zero_stage=2, offload="cpu")
    z3 = model_states(n, fp32, dp=dp, zero_stage=3, offload="cpu")
    assert (z2.device, z2.host) == (4 * n, 16 * n // dp)
    assert (z3.device, z3.host) == (0, 16 * n // dp)
    # mixed precision: the fp32 master is part of K = 12 already
    assert model_states(n, MIXED_ADAM, dp=dp, zero_stage=2, offload="cpu").host == 16 * n // dp


def test_deepspeed_zero2_offload_gpu_bytes() -> None:
    states = model_states(T5_3B, MIXED_ADAM, dp=8, zero_stage=2, offload="cpu")
    assert round(states.device / GIB, 2) == 5.31  # 2 bytes per parameter: the 16-bit weights stay on the GPU


def test_deepspeed_estimates_without_offload_count_more_than_the_zero_paper() -> None:
    # DeepSpeed's no-offload estimates are 4 Psi + 16 Psi / N (ZeRO-2) and 18 Psi / N + 4 L (ZeRO-3): they count
    # an fp32 gradient partition and (ZeRO-2) unsharded 16-bit gradient buckets. The ZeRO paper (used here) counts
    # 2 Psi + 14 Psi / N and 16 Psi / N. Pinned so that a change of either side is noticed.
    psi, n = T5_3B, 8
    deepspeed_zero2 = 4 * psi + int(16 * psi / n)
    deepspeed_zero3 = int(18 * psi / n)
    ours = model_states_bytes(psi, MIXED_ADAM, dp=n)
    assert round(deepspeed_zero2 / GIB, 2) == 15.93  # DeepSpeed docs, t5-3b, offload_optimizer=none
    assert psi % n == 0  # so that the shards are exact
    assert deepspeed_zero2 - ours["zero2"] == 2 * psi + 2 * psi // n
    assert deepspeed_zero3 - ours["zero3"] == 2 * psi // n


# --------------------------------------------------------------------------- Korthikanti et al. 2022
# "Reducing Activation Recomputation in Large Transformer Models", Table 2 (bytes per layer, 16-bit, dropout).
S, B, H, A = 2048, 1, 12288, 96  # GPT-3 175B (the paper's Table 3)


def _layer(**kw: object) -> int:
    return layer_activation_bytes(seq_len=S, micro_batch_size=B, hidden=H, heads=A, **kw)  # type: ignore[arg-type]


def test_korthikanti_table_2_coefficients() -> None:
    sbh = S * B * H
    assert _layer() == sbh * (34 + 5 * A * S // H)  # no parallelism: sbh (34 + 5as/h)
    assert _layer(tp=8) == sbh * (10 + 24 // 8) + 5 * A * S * S * B // 8  # TP: sbh (10 + 24/t + 5as/(ht))
    assert _layer(tp=8, sequence_parallel=True) == sbh * (34 + 5 * A * S // H) // 8  # TP + SP: / t
    assert _layer(tp=8, recompute="selective") == sbh * (10 + 3)  # TP + selective: sbh (10 + 24/t)
    assert _layer(tp=8, sequence_parallel=True, recompute="selective") == 34 * sbh // 8  # 34 sbh / t
    assert _layer(recompute="full") == 2 * sbh  # full recompute: the input, 2 sbh


# Korthikanti Sec. 4.2: for GPT-3 (a = 96, s = 2048, h = 12288) 5as/h = 80 and selective recompute saves 70 % of
# the activation memory; for MT-NLG (a = 128, s = 2048, h = 20480) 5as/h = 64 and it saves 65 %.
@pytest.mark.parametrize(("a", "h", "saved"), [(96, 12288, 0.70), (128, 20480, 0.65)])
def test_korthikanti_selective_recompute_savings(a: int, h: int, saved: float) -> None:
    kw = {"seq_len": 2048, "micro_batch_size": 1, "hidden": h, "heads": a, "tp": 8, "sequence_parallel": True}
    full = layer_activation_bytes(**kw)  # type: ignore[arg-type]
    selective = layer_activation_bytes(recompute="selective", **kw)  # type: ignore[arg-type]
    assert round(1 - selective / full, 2) == saved


def test_activation_coefficients_follow_element_size_and_dropout() -> None:
    sbh, as2b = S * B * H, A * S * S * B
    # fp32 with dropout: 16 e + 2 = 66 per sbh, 2 e + 1 = 9 per a s^2 b; without dropout the masks vanish.
    assert _layer(element_bytes=4) == 66 * sbh + 9 * as2b
    assert _layer(dropout=False) == 32 * sbh + 2 * as2b


def test_1f1b_first_stage_holds_the_whole_model_worth_of_layers() -> None:
    # Korthikanti Sec. 4.2.3: with 1F1B the first stage keeps p micro-batches of L/p layers = L layers' worth.
    shape = ModelShape(n_layer=8, n_embd=256, n_head=8, vocab_size=512, block_size=128, dropout=0.1)
    model, training = ModelSpec.from_shape(shape), TrainingSettings(precision="fp32")  # no autocast copies
    one = activation_bytes(model, training, ParallelConfig(data_parallel_size=1))
    four = activation_bytes(model, training, ParallelConfig(data_parallel_size=1, pipeline_parallel_size=4,
                                                            num_micro_batches=16))
    gpipe = activation_bytes(model, training, ParallelConfig(data_parallel_size=1, pipeline_parallel_size=4,
                                                             num_micro_batches=16, pipeline_schedule="gpipe"))
    # this library's GPT: SDPA's fused attention kernel
    per_layer = layer_activation_bytes(seq_len=128, micro_batch_size=1, hidden=256, heads=8, element_bytes=4,
                                       flash_attention=True)
    assert four == 8 * per_layer + 4 * 128 * 256  # 4 in flight x (2 layers + the embedding's dropout mask)
    assert one > four  # one device also holds the head's logits
    # GPipe keeps all m micro-batches on every stage: the last one's head (fp32: its LayerNorm's and its own input,
    # 8 s b h, and the logits, 4 s b V) outweighs the first's embedding mask
    assert gpipe == 16 * (2 * per_layer + 8 * 128 * 256 + 4 * 128 * 512)
    # bf16-mixed (autocast over fp32 weights, GPU): every micro-batch in flight also keeps its 16-bit weight copies
    # (Lightning's autocast has no cast cache) and its casts of q/k/v's shared input; the residual stream is fp32
    mixed = activation_bytes(model, TrainingSettings(), ParallelConfig(data_parallel_size=1, pipeline_parallel_size=4,
                                                                       num_micro_batches=16))
    per_layer = layer_activation_bytes(seq_len=128, micro_batch_size=1, hidden=256, heads=8, element_bytes=2,
                                       residual_bytes=4, norm_bytes=4, input_casts=2, flash_attention=True,
                                       sp_splits_inputs=False) + 2 * shape.block_matrix_params()
    assert mixed == 4 * (2 * per_layer + 128 * 256)


# --------------------------------------------------------------------------- model counts
def test_gpt2_small_parameter_count() -> None:
    # GPT-2 small as released (Radford et al. 2019; Hugging Face "gpt2"): 124,439,808 parameters.
    shape = ModelShape(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, block_size=1024, tie_embeddings=True,
                       key_bias=True)
    assert shape.total_params() == 124_439_808


@pytest.mark.parametrize(("bias", "tie"), [(True, False), (False, True), (True, True)])
def test_shape_count_matches_the_reference_gpt(bias: bool, tie: bool) -> None:
    from lightning_parallel.models import GPT

    module = GPT(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, bias=bias, tie_embeddings=tie)
    actual = sum({p.data_ptr(): p.numel() for p in module.parameters()}.values())
    shape = ModelShape(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, bias=bias, tie_embeddings=tie)
    assert shape.total_params() == actual
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())
    assert shape.largest_layer_params() == largest  # DeepSpeed's model_to_params definition


def test_stage_params_split_blocks_and_keep_embedding_and_head_apart() -> None:
    shape = ModelShape(n_layer=4, n_embd=64, n_head=4, vocab_size=128, block_size=32, tie_embeddings=True)
    whole = shape.stage_params(pp=1, tp=1)
    assert whole == shape.total_params()
    two = shape.stage_params(pp=2, tp=1)
    assert two == 2 * shape.block_params() + shape.embedding_params()  # the embedding stage is the busier one
    assert shape.stage_params(pp=1, tp=2) < whole / 2 + shape.block_size * 64 + 4 * 6 * 64 + 2 * 64


# --------------------------------------------------------------------------- units
def test_parse_bytes_and_counts() -> None:
    assert parse_bytes("32GB") == 32 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("512 mib") == 512 * 2**20
    assert parse_count("7.5e9") == 7_500_000_000
    assert parse_count("7.5B") == parse_count("7.5G") == 7_500_000_000
    assert parse_count("125M") == 125_000_000
    with pytest.raises(ValueError, match=r"32XB.*GiB"):
        parse_bytes("32XB", name="--gpu-memory")
    with pytest.raises(ValueError, match=r"7\.5Q"):
        parse_count("7.5Q", name="--params")
