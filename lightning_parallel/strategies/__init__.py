"""Lightning Strategy plugins: thin adapters over :mod:`lightning_parallel.parallel`.

``import lightning_parallel`` registers every name of :data:`STRATEGIES` with Lightning's strategy registry, so
``Trainer(strategy="lp_ddp")`` and ``--trainer.strategy lp_ddp`` work.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_parallel.config import SCHEDULES
from lightning_parallel.layouts import available_strategies, entry

from .auto import LPAutoStrategy
from .base import LayoutStrategy
from .ddp import LPDDPStrategy
from .dp import LPDPStrategy
from .hybrid import LPHybridStrategy
from .pipeline import LPPipelineStrategy
from .sharded import LPShardedStrategy
from .tensor import LPTensorStrategy
from .zero_offload import LPZeroOffloadStrategy

__all__ = ["STRATEGIES", "LPAutoStrategy", "LPDDPStrategy", "LPDPStrategy", "LPHybridStrategy", "LPPipelineStrategy",
           "LPShardedStrategy", "LPTensorStrategy", "LPZeroOffloadStrategy", "LayoutStrategy", "register_strategies"]

# name -> (class, description, preset init arguments)
STRATEGIES: dict[str, tuple[type, str, dict[str, Any]]] = {
    "lp_ddp": (LPDDPStrategy, f"DDP over the dp axis of a layout {entry('lp_ddp').region}; gloo on CPU, NCCL on CUDA",
               {}),
    "lp_ddp_fork": (
        LPDDPStrategy,
        "lp_ddp started by fork (cheap inside an already-imported process; notebooks, tests; CPU)",
        {"start_method": "fork"},
    ),
    "lp_ddp_spawn": (LPDDPStrategy, "lp_ddp started by torch.multiprocessing spawn", {"start_method": "spawn"}),
    "lp_dp": (LPDPStrategy, "thread-based data parallel: one process drives N devices (Lightning 1.x's dp)", {}),
    "dp": (LPDPStrategy, "alias of lp_dp: Lightning 1.x's strategy='dp', removed in Lightning 2", {}),
    "lp_sharded": (
        LPShardedStrategy,
        f"ZeRO over the dp axis {entry('lp_sharded').region}: parallel.zero_stage (default 2); backend native or "
        "fairscale",
        {},
    ),
    "ddp_sharded": (LPShardedStrategy, "alias of lp_sharded (ZeRO-2): Lightning 1.x's fairscale ddp_sharded", {}),
    "lp_sharded_fork": (LPShardedStrategy, "lp_sharded started by fork (tests, notebooks; CPU)",
                        {"start_method": "fork"}),
    "lp_zero1": (LPShardedStrategy, "lp_sharded at ZeRO stage 1 (optimizer states sharded)", {"zero_stage": 1}),
    "lp_zero2": (LPShardedStrategy, "lp_sharded at ZeRO stage 2 (+ gradients sharded)", {"zero_stage": 2}),
    "lp_zero3": (LPShardedStrategy, "lp_sharded at ZeRO stage 3 (+ parameters sharded; torch FSDP2)",
                 {"zero_stage": 3}),
    "lp_tensor": (
        LPTensorStrategy,
        "tensor parallelism over tp (the module's tensor_parallel_plan) x data parallelism over dp, "
        f"{entry('lp_tensor').region}",
        {},
    ),
    "lp_tensor_fork": (LPTensorStrategy, "lp_tensor started by fork (tests, notebooks; CPU)",
                       {"start_method": "fork"}),
    "lp_pipeline": (
        LPPipelineStrategy,
        f"pipeline stages over pp (the module's pipeline_layers; {', '.join(SCHEDULES)} schedules) x data "
        f"parallelism over dp, {entry('lp_pipeline').region}",
        {},
    ),
    "lp_pipeline_fork": (LPPipelineStrategy, "lp_pipeline started by fork (tests, notebooks; CPU)",
                         {"start_method": "fork"}),
    "lp_hybrid": (
        LPHybridStrategy,
        f"data x pipeline x tensor parallelism (+ ZeRO 1-3) from one parallel section, {entry('lp_hybrid').region}: TP "
        "inside a node, PP across nodes, DP over the rest",
        {},
    ),
    "lp_hybrid_fork": (LPHybridStrategy, "lp_hybrid started by fork (tests, notebooks; CPU)", {"start_method": "fork"}),
    "lp_zero_offload": (
        LPZeroOffloadStrategy,
        f"DeepSpeed ZeRO (+ offload) {entry('lp_zero_offload').region} (unset: ZeRO-2 + CPU offload)",
        {},
    ),
    "lp_zero_offload_fork": (LPZeroOffloadStrategy, "lp_zero_offload started by fork (tests, notebooks; CPU)",
                             {"start_method": "fork"}),
    "lp_zero3_offload": (
        LPZeroOffloadStrategy,
        "DeepSpeed ZeRO-3 + optimizer and parameters offloaded to CPU; CPU (gloo) or CUDA",
        {"zero_stage": 3, "offload": "cpu"},
    ),
    "lp_zero3_offload_nvme": (
        LPZeroOffloadStrategy,
        "DeepSpeed ZeRO-3 + optimizer and parameters on NVMe under parallel.nvme_path (ZeRO-Infinity; libaio)",
        {"zero_stage": 3, "offload": "nvme"},
    ),
    "lp_auto": (LPAutoStrategy, "the planner picks the strategy and layout from the module and the hardware (CLI)",
                {}),
}


def register_strategies(registry: Any = StrategyRegistry) -> None:
    """Bind every name of :data:`STRATEGIES` in Lightning's registry (idempotent). Every strategy the layout table
    (:mod:`lightning_parallel.layouts`) calls available is among them."""
    missing = [n for n in available_strategies() if n not in STRATEGIES]
    assert not missing, f"the layout table names strategies the registry lacks: {missing}"
    for name, (cls, description, params) in STRATEGIES.items():
        registry.register(name, cls, description=description, override=True, **params)
