"""Lightning Strategy plugins: thin adapters over :mod:`lightning_parallel.parallel`.

``import lightning_parallel`` registers every name of :data:`STRATEGIES` with Lightning's strategy registry, so
``Trainer(strategy="lp_ddp")`` and ``--trainer.strategy lp_ddp`` work.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from .base import LayoutStrategy
from .ddp import LPDDPStrategy

__all__ = ["STRATEGIES", "LPDDPStrategy", "LayoutStrategy", "register_strategies"]

# name -> (class, description, preset init arguments)
STRATEGIES: dict[str, tuple[type, str, dict[str, Any]]] = {
    "lp_ddp": (LPDDPStrategy, "DDP over the dp axis of a layout (N, 1, 1, 0); gloo on CPU, NCCL on CUDA", {}),
    "lp_ddp_fork": (
        LPDDPStrategy,
        "lp_ddp started by fork (cheap inside an already-imported process; notebooks, tests; CPU)",
        {"start_method": "fork"},
    ),
    "lp_ddp_spawn": (LPDDPStrategy, "lp_ddp started by torch.multiprocessing spawn", {"start_method": "spawn"}),
}


def register_strategies(registry: Any = StrategyRegistry) -> None:
    """Bind every name of :data:`STRATEGIES` in Lightning's registry (idempotent)."""
    for name, (cls, description, params) in STRATEGIES.items():
        registry.register(name, cls, description=description, override=True, **params)
