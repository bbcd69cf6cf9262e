"""Training settings that decide bytes per parameter and per activation.

Model-state bytes per parameter, as the ZeRO paper counts them (Rajbhandari et al. 2020, Sec. 3.1): with mixed
precision a parameter costs 2 bytes (16-bit weight) + 2 (16-bit gradient) + K optimizer bytes, K = 4 (fp32 master
weight) + the optimizer's own state: Adam/AdamW 8 (momentum and variance, fp32) -> K = 12; SGD with momentum 4 ->
K = 8; plain SGD 0 -> K = 4. In fp32 there is no master copy: 4 + 4 + (8 | 4 | 0).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

__all__ = ["Checkpointing", "MasterWeights", "Optimizer", "Precision", "StateBytes", "TrainingSettings",
           "normalize_precision"]

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed"]
Optimizer = Literal["adamw", "adam", "sgd-momentum", "sgd"]
Checkpointing = Literal["auto", "none", "selective", "full"]
MasterWeights = Literal["model", "optimizer"]
"""Activation checkpointing; ``auto`` lets the planner try none, selective and full for every layout."""

_PRECISION_ALIASES: dict[str, Precision] = {
    "fp32": "fp32",
    "32": "fp32",
    "32-true": "fp32",
    "float32": "fp32",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "fp16": "fp16-mixed",
    "16": "fp16-mixed",
    "16-mixed": "fp16-mixed",
    "fp16-mixed": "fp16-mixed",
}
_TRAINER_PRECISION: dict[Precision, str] = {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "fp16-mixed": "16-mixed"}
_OPTIMIZER_STATE: dict[str, int] = {"adamw": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0}


def normalize_precision(value: str) -> Precision:
    """``bf16``/``bf16-mixed`` -> bf16-mixed, ``16-mixed``/``fp16`` -> fp16-mixed, ``32``/``32-true`` -> fp32."""
    key = str(value).strip().lower()
    if key not in _PRECISION_ALIASES:
        raise ValueError(
            f"precision={value!r} is not known. Use fp32 (32-true), bf16-mixed (bf16) or fp16-mixed (16-mixed)."
        )
    return _PRECISION_ALIASES[key]


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state, and of the copies the data-parallel exchange moves."""

    param: int
    """The weight the device keeps: fp32 under Lightning's mixed precision (autocast casts it for each op), 16-bit
    where a separate fp32 master copy lives in the optimizer (:attr:`TrainingSettings.master_weights`)."""
    grad: int
    """Its gradient (the weight's dtype)."""
    optimizer: int
    """K: the optimizer's state, plus the fp32 master weight where the model's weight is 16-bit."""
    gather: int = 0
    """Bytes per element of the weights a sharded stage all-gathers (0: :attr:`param`'s): 2 for FSDP2 under
    ``bf16-mixed``, whose ``MixedPrecisionPolicy`` gathers bf16 copies of its fp32 shards."""
    reduce: int = 0
    """Bytes per element of the gradients the dp exchange reduces (0: :attr:`grad`'s)."""

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer

    @property
    def gathered(self) -> int:
        """:attr:`gather`, or the weight's bytes when unset."""
        return self.gather or self.param

    @property
    def reduced(self) -> int:
        """:attr:`reduce`, or the gradient's bytes when unset."""
        return self.reduce or self.grad


@dataclass(frozen=True)
class TrainingSettings:
    """Precision, optimizer and batch geometry; defaults are bf16 mixed precision with AdamW (16 bytes of model state
    per parameter: 4 + 4 + 8 as the library's engines keep them, 2 + 2 + 12 in the offload engine)."""

    precision: Precision = "bf16-mixed"
    """fp32, or bf16/fp16 mixed precision with fp32 master weights."""
    master_weights: MasterWeights = "model"
    """Where mixed precision keeps the fp32 weights the optimizer steps: ``model`` -- the model's own parameters stay
    fp32 and autocast computes each op in 16-bit (Lightning's ``bf16-mixed``/``16-mixed``: every engine of the library
    but the offload one; FSDP2 under ``bf16-mixed`` all-gathers bf16 copies of its fp32 shards); ``optimizer`` -- the
    model holds 16-bit weights and gradients and the optimizer an fp32 master copy (Megatron-LM; DeepSpeed's engine,
    which the library's offload layouts run whatever this says)."""
    optimizer: Optimizer = "adamw"
    """Adam/AdamW (8 bytes of state), SGD with momentum (4) or without (0)."""
    micro_batch_size: int = 1
    """Sequences per device per micro-batch (b)."""
    seq_len: int | None = None
    """Tokens per sequence (s); None = the model's block_size."""
    activation_checkpointing: Checkpointing = "auto"
    """auto (try all three), none, selective (recompute the attention core) or full (keep each block's input)."""
    num_micro_batches: int | None = None
    """Micro-batches per pipeline step (m); None = 4 x pipeline stages (bubble (p-1)/m below 25 %)."""
    batch_per_replica: int | None = None
    """The batch each dp replica reads per step, when a run fixes it (``lp_auto``: the data module's ``batch_size``):
    a pipeline layout then splits it into ``m`` micro-batches of ``batch_per_replica / m`` sequences, as the run does
    (``m``: its largest divisor from the stage count to 4 x stages; none: as without it), instead of taking
    ``micro_batch_size`` per micro-batch."""
    accumulate_grad_batches: int = 1
    """Batches whose gradients add up before each optimizer step (the Trainer's ``accumulate_grad_batches``)."""
    global_batch_size: int | None = None
    """Samples per optimizer step whatever the layout (the ``parallel`` section's ``global_batch_size``): a layout of
    ``dp`` replicas then accumulates ``global_batch_size / (batch x dp)`` batches (:meth:`accumulation`), as the run
    sets it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", normalize_precision(self.precision))
        if self.optimizer not in get_args(Optimizer):
            raise ValueError(f"optimizer={self.optimizer!r} is not known. Use one of {list(get_args(Optimizer))}.")
        if self.master_weights not in get_args(MasterWeights):
            raise ValueError(f"master_weights={self.master_weights!r}: use model or optimizer.")
        if self.activation_checkpointing not in get_args(Checkpointing):
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r}: use auto, none, selective or full."
            )
        for key in ("micro_batch_size", "seq_len", "num_micro_batches", "batch_per_replica", "accumulate_grad_batches",
                    "global_batch_size"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{key}={value!r} must be a positive integer.")

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    @property
    def state_bytes(self) -> StateBytes:
        """:meth:`state_bytes_for` a layout without ZeRO-3 or offload (DDP, ZeRO-1/2's flat shards, tensor
        parallelism): the same bytes per parameter at every stage of them."""
        return self.state_bytes_for()

    def state_bytes_for(self, *, offload: str = "none", fsdp: bool = False) -> StateBytes:
        """Bytes per parameter of the model states on a device of a layout, as its engine keeps them:

        * fp32: weight 4, gradient 4, the optimizer's state;
        * mixed precision with ``master_weights="model"`` (Lightning's autocast, the library's engines): the same --
          the fp32 weights are the optimizer's, the gradients fp32 and reduced in fp32 -- except that FSDP2
          (``fsdp``: ZeRO-3, ZeRO-2 in pipeline stages, HSDP) under ``bf16-mixed`` all-gathers 2-byte copies;
        * mixed precision with ``master_weights="optimizer"``, and the offload engine (``offload`` cpu/nvme: DeepSpeed
          keeps 16-bit weights on the device whatever ``master_weights`` says): weight 2, gradient 2, and the fp32
          master (4) with the optimizer's state -- the ZeRO paper's ``2 + 2 + K``."""
        state = _OPTIMIZER_STATE[self.optimizer]
        if not self.mixed:
            return StateBytes(param=4, grad=4, optimizer=state)
        if self.master_weights == "optimizer" or offload != "none":
            return StateBytes(param=2, grad=2, optimizer=4 + state)
        return StateBytes(param=4, grad=4, optimizer=state, gather=2 if fsdp and self.precision == "bf16-mixed" else 4)

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element a 16-bit op writes (a matmul's output): 2 under mixed precision, 4 in
        fp32."""
        return 2 if self.mixed else 4

    def autocast_casts(self, *, offload: str = "none", fsdp: bool = False) -> bool:
        """Whether autocast casts fp32 weights and activations to 16 bits op by op, keeping the casts it saves for
        backward: Lightning's mixed precision over fp32 weights (``master_weights="model"``), except in the offload
        engine (16-bit weights) and under FSDP2 with ``bf16-mixed`` (``fsdp``: its ``MixedPrecisionPolicy`` gathers
        bf16 weights and casts each unit's inputs to bf16, so there is nothing left to cast)."""
        return self._autocast(offload) and not (fsdp and self.precision == "bf16-mixed")

    def _autocast(self, offload: str) -> bool:
        """Lightning's autocast over fp32 weights runs: mixed precision, the model's weights the master, no offload
        engine (whose DeepSpeed module holds 16-bit weights)."""
        return self.mixed and self.master_weights == "model" and offload == "none"

    def residual_bytes(self, *, offload: str = "none", fsdp: bool = False) -> int:
        """Bytes of one element of the residual stream -- a block's input and output, the LayerNorms' inputs, what a
        pipeline stage sends to the next: 4 in fp32 and where autocast casts op by op (:meth:`autocast_casts`: the
        embedding's fp32 output plus each block's 16-bit branches stays fp32), 2 where the weights are 16-bit
        (``master_weights="optimizer"``, the offload engine) or FSDP2 casts each unit's inputs to bf16."""
        return 4 if not self.mixed or self.autocast_casts(offload=offload, fsdp=fsdp) else 2

    def norm_bytes(self, *, offload: str = "none", fsdp: bool = False, gpu: bool = True) -> int:
        """Bytes of an element of a LayerNorm's input and output: the residual stream's, but 4 wherever autocast runs
        on a GPU (CUDA's autocast runs LayerNorm in fp32: on FSDP2's bf16 units it keeps an fp32 copy of the input
        and returns fp32, which q, k and v then cast again; the CPU's runs it in the input's dtype)."""
        return 4 if self._autocast(offload) and gpu else self.residual_bytes(offload=offload, fsdp=fsdp)

    @property
    def trainer_precision(self) -> str:
        """The value of Lightning's ``Trainer(precision=...)``."""
        return _TRAINER_PRECISION[self.precision]

    @property
    def checkpointing_options(self) -> tuple[str, ...]:
        """The activation-checkpointing settings to try, lightest first."""
        if self.activation_checkpointing == "auto":
            return ("none", "selective", "full")
        return (self.activation_checkpointing,)

    def micro_batches(self, pp: int) -> int:
        """m for a pipeline of pp stages (1 without a pipeline)."""
        if pp == 1:
            return 1
        if self.num_micro_batches is not None:
            return self.num_micro_batches
        if self.batch_per_replica is not None:
            fitting = [d for d in range(pp, 4 * pp + 1) if self.batch_per_replica % d == 0]
            if fitting:  # else no split keeps every stage busy: the micro-batch is taken as given
                return max(fitting)
        return 4 * pp

    def accumulation(self, dp: int, pp: int = 1) -> int:
        """Batches accumulated per optimizer step by a layout of ``dp`` replicas and ``pp`` stages: with
        :attr:`global_batch_size`, ``global_batch_size / (batch x dp)`` (the batch a replica reads per step: the
        data module's, else ``micro_batch_size`` x the pipeline's micro-batches; at least 1), else
        :attr:`accumulate_grad_batches`."""
        if self.global_batch_size is None:
            return self.accumulate_grad_batches
        return max(1, self.global_batch_size // (self._replica_batch(pp) * dp))

    @property
    def accumulation_text(self) -> str:
        """How the steps accumulate, for the reports ("" when they do not)."""
        if self.global_batch_size is not None:
            return (f"global batch {self.global_batch_size} (each layout accumulates global / (batch x dp) batches; "
                    "ZeRO-2/3 keep the whole gradient until a step's last)")
        if self.accumulate_grad_batches > 1:
            return (f"{self.accumulate_grad_batches} batches accumulated per step (ZeRO-2/3 keep the whole gradient "
                    "until a step's last)")
        return ""

    def _replica_batch(self, pp: int) -> int:
        """Sequences a replica reads per batch: the data module's, else a micro-batch times the pipeline's."""
        return self.batch_per_replica or self.micro_batch_size * self.micro_batches(pp)

    def global_batch_refusal(self, dp: int, pp: int = 1) -> str:
        """Why a layout of ``dp`` replicas cannot train :attr:`global_batch_size` (the run refuses a world where
        ``global / (batch x dp)`` is not a whole number >= 1), with the arithmetic; "" when it can or none is set."""
        if self.global_batch_size is None:
            return ""
        batch = self._replica_batch(pp)
        if self.global_batch_size % (batch * dp) == 0:
            return ""
        return (f"global_batch_size {self.global_batch_size} is not a multiple of batch x dp = {batch} x {dp} = "
                f"{batch * dp} ({self.global_batch_size} % {batch * dp} = {self.global_batch_size % (batch * dp)})")

    def for_pipeline(self, pp: int) -> TrainingSettings:
        """The settings a layout of ``pp`` stages runs with: with :attr:`batch_per_replica` and ``pp > 1``,
        micro-batches of ``batch_per_replica / m`` sequences and that ``m``; else these settings."""
        if pp == 1 or self.batch_per_replica is None or self.num_micro_batches is not None:
            return self
        m = self.micro_batches(pp)
        if self.batch_per_replica % m:
            return self
        return replace(self, micro_batch_size=max(1, self.batch_per_replica // m), num_micro_batches=m)

    def sequence_length(self, default: int) -> int:
        return self.seq_len if self.seq_len is not None else default
