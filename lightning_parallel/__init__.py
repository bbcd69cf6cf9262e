"""lightning-parallel: DP, DDP, ZeRO (sharded DDP), ZeRO-offload, tensor, pipeline and hybrid (dp x pp x tp)
parallelism for PyTorch Lightning, with a layout planner.

Importing the package registers its strategies with Lightning (``Trainer(strategy="lp_ddp")``).
"""

from lightning_parallel.config import LayoutError, ParallelConfig, UserInputError, check_model_compat
from lightning_parallel.grads import grad_norm
from lightning_parallel.module_hooks import ParallelModuleMixin, PipelineLayer
from lightning_parallel.parallel.dims import ParallelDims
from lightning_parallel.strategies import LayoutStrategy, LPDDPStrategy, register_strategies

__version__ = "0.1.0"

register_strategies()

__all__ = [
    "LPDDPStrategy",
    "LayoutError",
    "LayoutStrategy",
    "ParallelConfig",
    "ParallelDims",
    "ParallelModuleMixin",
    "PipelineLayer",
    "UserInputError",
    "__version__",
    "check_model_compat",
    "grad_norm",
    "register_strategies",
]
