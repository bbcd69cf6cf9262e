"""Lightning Strategy plugins: thin adapters over :mod:`lightning_parallel.parallel`.

``import lightning_parallel`` registers every name of :data:`STRATEGIES` with Lightning's strategy registry, so
``Trainer(strategy="lp_ddp")`` and ``--trainer.strategy lp_ddp`` work.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_parallel.layouts import available_strategies

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
    "lp_ddp": (LPDDPStrategy, "DDP over the dp axis of a layout (N, 1, 1, 0); gloo on CPU, NCCL on CUDA", {}),
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
        "ZeRO over the dp axis (N, 1, 1, z): parallel.zero_stage 1|2|3 (default 2); backend native or fairscale",
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
        "tensor parallelism over tp (the module's tensor_parallel_plan) x data parallelism over dp, (N/t, 1, t, 0|1|3)",
        {},
    ),
    "lp_tensor_fork": (LPTensorStrategy, "lp_tensor started by fork (tests, notebooks; CPU)",
                       {"start_method": "fork"}),
    "lp_pipeline": (
        LPPipelineStrategy,
        "pipeline stages over pp (the module's pipeline_layers; gpipe, 1f1b, interleaved_1f1b, zero_bubble schedules)"
        " x data parallelism over dp, (N/p, p, 1, 0|1)",
        {},
    ),
    "lp_pipeline_fork": (LPPipelineStrategy, "lp_pipeline started by fork (tests, notebooks; CPU)",
                         {"start_method": "fork"}),
    "lp_hybrid": (
        LPHybridStrategy,
        "data x pipeline x tensor parallelism (+ ZeRO-1) from one parallel section, (d, p, t, 0|1): TP inside a node, "
        "PP across nodes, DP over the rest",
        {},
    ),
    "lp_hybrid_fork": (LPHybridStrategy, "lp_hybrid started by fork (tests, notebooks; CPU)", {"start_method": "fork"}),
    "lp_zero_offload": (
        LPZeroOffloadStrategy,
        "DeepSpeed ZeRO (+ offload): parallel.zero_stage 1|2|3, offload none|cpu|nvme (unset: ZeRO-2 + CPU offload)",
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
