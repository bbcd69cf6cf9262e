"""ZeRO-2/3 (FSDP2) inside pipelines and hybrids, and HSDP (replicate x shard), against one device.

Same global batch and seed as one device, 10 AdamW steps with clipping 0.5 by the global norm and accumulation over 2
batches (``tests/trainer/token_data.fit``). Every run also measures, on every rank after the last step, the model-state
bytes (parameters, gradients, AdamW state) against the at-rest FSDP2 formula ``(4 + 4 + 8) Psi_rank / s`` (``Psi_rank``
the parameters this rank holds before dp sharding: its stages' layers, its tp shards; ``s`` the shard-group size), and
counts the reduce-scatters of the last batch: one per FSDP2 unit of the rank, however many micro-batches the pipeline
ran (the gradient reduction waits for the step's last micro-batch).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

import lightning_parallel  # noqa: F401
from lightning_parallel.callbacks import CountCommunication
from lightning_parallel.callbacks.model_states import measure_rank_states
from lightning_parallel.config import LayoutError, ParallelConfig
from lightning_parallel.models import GPT
from lightning_parallel.parallel.tensor.sync import is_tp_sharded
from lightning_parallel.strategies import LPHybridStrategy, LPPipelineStrategy, LPShardedStrategy, LPTensorStrategy
from tests.trainer.token_data import STEPS, T, fit, weight_diff

ADAMW_BYTES = 4 + 4 + 8  # fp32 weight, gradient, two moments


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(n_layer=6, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3, bias=False)


@pytest.fixture(scope="module")
def reference() -> GPT:
    return fit("auto", 1, 1, model=_gpt())[0]


class _Measure(CountCommunication):
    """On the last batch: this rank's model-state bytes, its parameters before dp sharding, its FSDP2 units and the
    reduce-scatters of the batch; gathered to rank 0 and logged (the fork launcher hands rank 0's metrics back)."""

    def __init__(self) -> None:
        self.before = 0

    def _reduce_scatters(self, trainer: pl.Trainer) -> int:
        counter = trainer.strategy.comm_counter  # type: ignore[attr-defined]
        return counter.count(kind="reduce_scatter")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.before = self._reduce_scatters(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step < STEPS:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        dims = trainer.strategy.dims  # type: ignore[attr-defined]
        states = measure_rank_states(trainer, pl_module)
        psi = sum(p.numel() // dims.tp if is_tp_sharded(p) else p.numel() for p in pl_module.parameters())
        units = sum(1 for m in pl_module.modules()
                    if isinstance(m, FSDPModule) and fully_shard.state(m)._fsdp_param_group is not None)
        mine = {"states": states["params"] + states["grads"] + states["optimizer"], "psi": psi, "units": units,
                "rs": self._reduce_scatters(trainer) - self.before}
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        worst = max(range(len(ranks)), key=lambda r: ranks[r]["states"] / ranks[r]["psi"])
        formula = max(ADAMW_BYTES * r["psi"] / dims.dp_shard for r in ranks)
        pl_module.log_dict({"states_max": float(max(r["states"] for r in ranks)), "formula_max": float(formula),
                            "ratio_worst": ranks[worst]["states"] / (ADAMW_BYTES * ranks[worst]["psi"] / dims.dp_shard),
                            "rs_per_unit_min": float(min(r["rs"] / max(1, r["units"]) for r in ranks)),
                            "rs_per_unit_max": float(max(r["rs"] / max(1, r["units"]) for r in ranks)),
                            "units_min": float(min(r["units"] for r in ranks))}, rank_zero_only=True)


PIPELINE = {"pipeline_parallel_size": 2, "num_micro_batches": 2}
INTERLEAVED = {"pipeline_parallel_size": 2, "num_micro_batches": 2, "pipeline_schedule": "interleaved_1f1b",
               "virtual_pipeline_stages": 2}
CASES = [
    pytest.param(LPPipelineStrategy, {**PIPELINE, "zero_stage": 2}, 4, id="pp2-dp2-zero2-1f1b"),
    pytest.param(LPPipelineStrategy, {**PIPELINE, "zero_stage": 3}, 4, id="pp2-dp2-zero3-1f1b"),
    pytest.param(LPPipelineStrategy, {**INTERLEAVED, "zero_stage": 2}, 4, id="pp2-dp2-zero2-interleaved"),
    pytest.param(LPPipelineStrategy, {**INTERLEAVED, "zero_stage": 3}, 4, id="pp2-dp2-zero3-interleaved"),
    pytest.param(LPPipelineStrategy, {**PIPELINE, "zero_stage": 3, "pipeline_schedule": "gpipe"}, 4,
                 id="pp2-dp2-zero3-gpipe"),
    pytest.param(LPPipelineStrategy, {**PIPELINE, "zero_stage": 3, "pipeline_schedule": "zero_bubble"}, 4,
                 id="pp2-dp2-zero3-zero_bubble"),
    pytest.param(LPShardedStrategy, {"zero_stage": 3, "data_parallel_shard_size": 2}, 4, id="hsdp2x2-sharded-zero3"),
    pytest.param(LPShardedStrategy, {"zero_stage": 2, "data_parallel_shard_size": 2}, 4, id="hsdp2x2-sharded-zero2"),
    pytest.param(LPHybridStrategy, {**PIPELINE, "tensor_parallel_size": 2, "zero_stage": 3}, 8,
                 id="dp2-pp2-tp2-zero3", marks=pytest.mark.slow),
    pytest.param(LPTensorStrategy, {"tensor_parallel_size": 2, "zero_stage": 3, "data_parallel_shard_size": 2}, 8,
                 id="hsdp2x2-tp2-zero3", marks=pytest.mark.slow),
    pytest.param(LPPipelineStrategy, {"pipeline_parallel_size": 2, "num_micro_batches": 1,  # 1 sample per dp rank
                                      "pipeline_schedule": "gpipe", "zero_stage": 3, "data_parallel_shard_size": 2},
                 8, id="hsdp2x2-pp2-zero3", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("cls", "layout", "devices"), CASES)
def test_fsdp_layouts_equal_one_device_and_hold_the_formula(reference: GPT, cls: Any, layout: dict[str, Any],
                                                            devices: int) -> None:
    strategy = cls(layout, start_method="fork")
    dp = devices // (layout.get("pipeline_parallel_size", 1) * layout.get("tensor_parallel_size", 1))
    model, trainer = fit(strategy, devices, dp, model=_gpt(), callbacks=[_Measure()])
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}
    diff = weight_diff(model, reference)
    print(f"{strategy.describe()}: max |w - w_1dev| = {diff:.2e}; model states per rank (busiest) "
          f"{m['states_max']:.0f} B vs formula {m['formula_max']:.0f} B (worst ratio {m['ratio_worst']:.4f}); "
          f"reduce-scatters per FSDP2 unit in the last batch {m['rs_per_unit_min']:.0f}-{m['rs_per_unit_max']:.0f}")
    assert diff < 2e-5
    assert m["units_min"] > 0  # FSDP2 really wraps every rank's layers
    # at rest after the step: everything sharded over the shard group (padding and AdamW's step counters aside)
    assert 1.0 <= m["ratio_worst"] < 1.02
    # one reduce-scatter per unit and batch, not one per micro-batch
    assert m["rs_per_unit_min"] == m["rs_per_unit_max"] == 1.0


class _ZeroesItsOwnParameters(GPT):
    """Zeroes the gradients by walking its own parameters, not through the optimizer."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        for p in self.parameters():
            p.grad = None


@pytest.mark.parametrize(("layout", "devices"), [
    pytest.param({"zero_stage": 3}, 2, id="zero3-dp2"),
    pytest.param({"zero_stage": 2, "data_parallel_shard_size": 2}, 4, id="hsdp2x2-zero2"),
])
def test_a_module_zeroing_its_own_parameters_trains_as_one_device(reference: GPT, layout: dict[str, Any],
                                                                  devices: int) -> None:
    """Lightning zeroes between training_step and backward, where FSDP2 holds the units it keeps gathered after their
    forward (the root, ZeRO-3's head, every unit of ZeRO-2 over FSDP2) as unsharded copies: a module's own
    optimizer_zero_grad walking self.parameters() reached the copies and the last step's sharded gradients were added
    to (6.1e-03 at ZeRO-3, 1.5e-02 under HSDP ZeRO-2 from one device). The strategy moves the zero-grad call in front
    of training_step. (One device's p.grad = None is the optimizer's zero_grad: the plain GPT's reference.)"""
    torch.manual_seed(0)
    model = _ZeroesItsOwnParameters(n_layer=6, n_head=2, n_embd=32, block_size=T, vocab_size=64, warmup_steps=3,
                                    bias=False)
    strategy = LPShardedStrategy(layout, start_method="fork")
    fit(strategy, devices, devices, model=model)
    diff = weight_diff(model, reference)
    print(f"{strategy.describe()}, the module's own p.grad = None: max |w - w_1dev| = {diff:.2e}")
    assert diff < 2e-5


def test_hsdp_groups_and_the_cross_node_warning() -> None:
    """The dp axis splits into shard groups of consecutive dp coordinates and replicate groups across them; on several
    nodes a shard group that crosses a node is warned about (FSDP2's collectives would run between nodes)."""
    from lightning_parallel.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(ParallelConfig(data_parallel_size=4, pipeline_parallel_size=2,
                                                   data_parallel_shard_size=2, zero_stage=3), world_size=8)
    assert dims.hsdp and dims.dp_replicate == 2
    assert dims.dp_subgroup_ranks("dp_shard", 0) == [0, 2] and dims.dp_subgroup_ranks("dp_replicate", 0) == [0, 4]
    assert not dims.shard_group_crosses_nodes(4) and dims.shard_group_crosses_nodes(2)
    with pytest.warns(UserWarning, match=r"data_parallel_shard_size=4: a shard group .* crosses nodes of 4 devices.*"
                                         r"Fix: data_parallel_shard_size <= 2"):
        ParallelDims.from_config(ParallelConfig(data_parallel_size=8, pipeline_parallel_size=2, zero_stage=3,
                                                data_parallel_shard_size=4), world_size=16, devices_per_node=4,
                                 num_nodes=4)


def test_layout_rules_of_fsdp_and_hsdp() -> None:
    assert LPPipelineStrategy({**PIPELINE, "zero_stage": 3}).layout.zero == 3  # no longer refused
    assert LPHybridStrategy({**PIPELINE, "tensor_parallel_size": 2, "zero_stage": 2}).layout.zero == 2
    with pytest.raises(LayoutError, match=r"data_parallel_shard_size=2 .*zero_stage=1.*Fix: zero_stage=3"):
        ParallelConfig(zero_stage=1, data_parallel_shard_size=2)
    with pytest.raises(LayoutError, match=r"data_parallel_shard_size=3 does not divide data_parallel_size=4.*Fix"):
        ParallelConfig(data_parallel_size=4, zero_stage=3, data_parallel_shard_size=3)
    with pytest.raises(LayoutError, match=r"does not divide the data-parallel size dp=4"):
        pl.Trainer(strategy=LPShardedStrategy({"zero_stage": 3, "data_parallel_shard_size": 3}), accelerator="cpu",
                   devices=4, logger=False)
    with pytest.raises(LayoutError, match=r"lp_zero_offload runs DeepSpeed's ZeRO over the whole dp axis"):
        from lightning_parallel.strategies import LPZeroOffloadStrategy

        LPZeroOffloadStrategy({"zero_stage": 2, "offload": "none", "data_parallel_shard_size": 2})
    with pytest.raises(LayoutError, match=r"zero_stage=0 shards nothing of the parameters or gradients"):
        LPTensorStrategy({"tensor_parallel_size": 2, "data_parallel_shard_size": 2})
    with pytest.raises(LayoutError, match=r"reshard_after_forward=True is an FSDP2 setting"):
        ParallelConfig(zero_stage=1, reshard_after_forward=True)
    with pytest.raises(LayoutError, match=r"lp_sharded runs zero_stage=2 over the whole dp axis"):
        LPShardedStrategy({"zero_stage": 2, "reshard_after_forward": False})
    with pytest.raises(LayoutError, match=r"backend='fairscale' shards over the whole dp axis"):
        LPShardedStrategy({"zero_stage": 2, "data_parallel_shard_size": 2}, backend="fairscale")
    with pytest.raises(LayoutError, match=r"lp_hybrid runs zero_stage=2 as FSDP2 per pipeline stage.*Fix: zero_stage="):
        LPHybridStrategy({"tensor_parallel_size": 2, "zero_stage": 2})
