"""ZeRO over the ``dp`` axis of the layout mesh: stages 1-2 (:class:`ZeroOptimizer`, flat balanced shards),
stage 3 (:func:`apply_zero3`, torch FSDP2), an optional fairscale backend, and the measurement of per-rank bytes
and communicated bytes against the ZeRO formulas. No Lightning import.

Stage ``s`` over ``N`` dp ranks (``Psi`` parameters; ``P``, ``G``, ``K`` bytes per parameter of parameters,
gradients, optimizer state) keeps ``(P+G)Psi + K Psi/N`` (1), ``P Psi + (G+K)Psi/N`` (2), ``(P+G+K)Psi/N`` (3) per
rank, and moves ``2 Psi`` (1, 2) or ``3 Psi`` (3) elements x ``(N-1)/N`` per rank and step.
"""

from .comm import all_gather_into, broadcast_module_states, reduce_scatter_mean
from .fairscale_backend import FairscaleUnavailableError, exact_oss, fairscale_sharded_ddp, require_fairscale
from .flat import FlatShard, flat_group_refusal
from .memory import ModelStateBytes, measure_model_state, zero_comm_theory, zero_memory_formula
from .optimizer import ZeroOptimizer
from .overlap import ChunkedReduce
from .stage3 import (
    apply_zero3,
    fsdp2_dtype_refusal,
    fsdp2_parameter_refusal,
    last_in_forward,
    zero3_full_model_state,
    zero3_full_optimizer_state,
    zero3_load_full_model_state,
    zero3_load_full_optimizer_state,
    zero3_load_local_state,
    zero3_local_state,
)

__all__ = [
    "ChunkedReduce",
    "FairscaleUnavailableError",
    "FlatShard",
    "ModelStateBytes",
    "ZeroOptimizer",
    "all_gather_into",
    "apply_zero3",
    "broadcast_module_states",
    "exact_oss",
    "fairscale_sharded_ddp",
    "flat_group_refusal",
    "fsdp2_dtype_refusal",
    "fsdp2_parameter_refusal",
    "last_in_forward",
    "measure_model_state",
    "reduce_scatter_mean",
    "require_fairscale",
    "zero3_full_model_state",
    "zero3_full_optimizer_state",
    "zero3_load_full_model_state",
    "zero3_load_full_optimizer_state",
    "zero3_load_local_state",
    "zero3_local_state",
    "zero_comm_theory",
    "zero_memory_formula",
]
