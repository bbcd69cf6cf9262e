"""ZeRO-offload on the DeepSpeed engine (CPU and NVMe), with no Lightning import.

* :mod:`.config` -- the typed, closed DeepSpeed config (``zero_optimization``, ``offload_optimizer``,
  ``offload_param``, ``aio``, batch sizes) merged over an optional whole DeepSpeed config;
* :mod:`.ops` -- which C++ ops a run needs, building them once with a progress message, the libaio check;
* :mod:`.optim` -- the user's Adam/AdamW mapped to DeepSpeed's CPU Adam, the LR scheduler re-bound;
* :mod:`.engine` -- ``deepspeed.initialize`` from the above;
* :mod:`.state` -- a consolidated fp32 state dict, and NVMe-offloaded state taken and restored (verified) per rank
  (stored on disk by :mod:`lightning_parallel.checkpoint.formats.deepspeed`);
* :mod:`.accounting` -- per-rank bytes of parameters, gradients and optimizer state on the device and on the host.
"""

from .config import (
    AioConfig,
    OffloadConfigError,
    OffloadDevice,
    OffloadEngineConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroOptimizationConfig,
    check_batch_sizes,
    deep_merge,
    load_deepspeed_config,
)
from .engine import build_engine, offload_targets
from .ops import LIBAIO_HELP, OpsUnavailableError, ensure_ops, libaio_available, missing_ops, required_ops
from .optim import OptimizerNotOffloadableError, rebind_scheduler, to_host_optimizer
from .state import ResumeVerificationError, consolidated_state_dict, local_state, restore_local_state

__all__ = [
    "LIBAIO_HELP",
    "AioConfig",
    "OffloadConfigError",
    "OffloadDevice",
    "OffloadEngineConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OpsUnavailableError",
    "OptimizerNotOffloadableError",
    "ResumeVerificationError",
    "ZeroOptimizationConfig",
    "build_engine",
    "check_batch_sizes",
    "consolidated_state_dict",
    "deep_merge",
    "ensure_ops",
    "libaio_available",
    "load_deepspeed_config",
    "local_state",
    "missing_ops",
    "offload_targets",
    "rebind_scheduler",
    "required_ops",
    "restore_local_state",
    "to_host_optimizer",
]
