"""The cases of the table (the library, its hand-written torch anchor, Lightning's built-in) and the GPT sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ROLES = ("ours", "torch", "lightning")
DEFAULT_DP = 2
"""The data-parallel size of the dp-only cases unless ``--dp`` says otherwise."""


@dataclass(frozen=True)
class Case:
    key: str
    """The technique: which strategy, anchor and formula (``ddp``, ``zero3``, ...)."""
    template: str
    """The library's variant, ``{dp}`` standing for the data-parallel size."""
    dp: int
    pp: int = 1
    tp: int = 1
    zero: int = 0
    offload: str = "none"
    anchor: str = ""
    """What the hand-written torch loop is."""
    lightning: str | None = None
    """Lightning's built-in on CPU (None: the reason in ``lightning_missing``)."""
    lightning_cuda: str | None = None
    lightning_missing: str = ""
    processes: int | None = None
    """Processes to start (default dp x pp x tp; lp_dp: one)."""
    shard: int = 0
    """HSDP's shard-group size (0: none, FSDP2 over the whole dp axis)."""
    label: str = ""
    """The row's name when it differs from ``key`` (a case run at another ``--dp``)."""
    cp: int = 1
    """Context parallelism: the ranks each sequence is split over."""
    loop_cost: bool = False
    """Run only for Lightning's own per-step cost at this many ranks (``ddp`` at another case's world size; see
    :func:`loop_cases`): no calibration, prediction or profile of its own."""

    @property
    def name(self) -> str:
        return self.label or self.key

    @property
    def title(self) -> str:
        return self.template.format(dp=self.dp)

    @property
    def world(self) -> int:
        return self.processes if self.processes is not None else self.dp * self.pp * self.tp * self.cp

    @property
    def scalable(self) -> bool:
        """Data parallelism alone: ``--dp`` sets its size."""
        return self.pp == 1 and self.tp == 1 and self.cp == 1 and not self.shard

    def with_dp(self, n: int) -> Case:
        """This case on ``n`` data-parallel ranks (lp_dp: ``n`` replicas), named ``key-dpN`` unless ``n`` is the
        default size."""
        return dataclasses.replace(self, dp=n, label="" if n == DEFAULT_DP else f"{self.key}-dp{n}")


CASES: dict[str, Case] = {c.key: c for c in (
    Case("dp", "lp_dp ({dp} replicas, 1 process)", dp=DEFAULT_DP, processes=1,
         anchor="one process, whole batch (nn.DataParallel on CUDA; it refuses CPU)",
         lightning_missing="Lightning 2 removed dp"),
    Case("ddp", "lp_ddp x{dp}", dp=DEFAULT_DP, anchor="torch DistributedDataParallel", lightning="ddp",
         lightning_cuda="ddp"),
    Case("zero1", "lp_sharded zero1 x{dp}", dp=DEFAULT_DP, zero=1, anchor="DDP + torch ZeroRedundancyOptimizer",
         lightning_cuda="deepspeed_stage_1", lightning_missing="Lightning has no ZeRO-1 on CPU (deepspeed: CUDA only)"),
    Case("zero2", "lp_sharded zero2 x{dp}", dp=DEFAULT_DP, zero=2,
         anchor="FSDP2 fully_shard(reshard_after_forward=False)", lightning_cuda="deepspeed_stage_2",
         lightning_missing="Lightning has no ZeRO-2 on CPU (deepspeed: CUDA only)"),
    Case("zero3", "lp_sharded zero3 x{dp}", dp=DEFAULT_DP, zero=3,
         anchor="FSDP2 fully_shard per block, embedding, head + root",
         lightning="model_parallel", lightning_cuda="model_parallel"),
    Case("offload", "lp_zero_offload z2+cpu x{dp}", dp=DEFAULT_DP, zero=2, offload="cpu",
         anchor="bare deepspeed.initialize engine, same config", lightning_cuda="deepspeed_stage_2_offload",
         lightning_missing="Lightning's deepspeed refuses CPU"),
    Case("tp", "lp_tensor tp2", dp=1, tp=2, anchor="DTensor parallelize_module (Megatron plan) + loss_parallel",
         lightning="model_parallel", lightning_cuda="model_parallel"),
    Case("tp2d", "lp_tensor dp2 x tp2 zero3", dp=2, tp=2, zero=3, anchor="DTensor TP + FSDP2 over dp",
         lightning="model_parallel", lightning_cuda="model_parallel"),
    Case("pp", "lp_pipeline pp2 1F1B", dp=1, pp=2, anchor="torch.distributed.pipelining Schedule1F1B",
         lightning_missing="Lightning 2 removed pipelines"),
    Case("hybrid", "lp_hybrid dp2 x pp2 x tp2", dp=2, pp=2, tp=2,
         anchor="pipelining over DTensor TP + dp gradient all-reduce", lightning_missing="no hybrid in Lightning"),
    Case("ppzero3", "lp_pipeline dp2 x pp2 zero3 1F1B", dp=2, pp=2, zero=3,
         anchor="torch.distributed.pipelining Schedule1F1B over fully_shard stages (FSDP2 per stage over dp)",
         lightning_missing="Lightning 2 removed pipelines"),
    Case("hsdp", "lp_sharded zero3 HSDP 2 replicas x 2 shards", dp=4, zero=3, shard=2,
         anchor="FSDP2 fully_shard per block, embedding, head + root on a 2-D (replicate, shard) mesh",
         lightning_missing="Lightning's ModelParallelStrategy has no HSDP"),
    Case("cp", "lp_ddp cp2 (ring attention)", dp=1, cp=2,
         anchor="CPU: a hand loop over the library's ring-attention units + DDP over cp (torch's context_parallel "
                "dispatches CUDA attention kernels only); CUDA: torch context_parallel (head-tail, all-gather "
                "rotation) + DDP over cp",
         lightning_missing="Lightning has no context parallelism"),
)}


def expand(keys: list[str], dps: list[int]) -> list[Case]:
    """The runs of ``--cases`` x ``--dp``: every data-parallel-only case once per size, the others once."""
    out: list[Case] = []
    for key in keys:
        case = CASES[key]
        out.extend([case.with_dp(n) for n in dps] if case.scalable else [case])
    return out


def loop_cases(cases: list[Case], roles: list[str]) -> list[Case]:
    """``ddp`` at every other world size among ``cases``, to measure Lightning's own per-step cost (its ``ddp`` minus
    torch DDP) at the number of ranks each case runs on: where ranks share the cores (CPU), each rank's loop work
    takes turns with the others', so the cost by the wall clock grows with the ranks per core (measured here
    2026-12-06: 3.8 ms at 2 ranks on 2 cores, 8.9 ms at 4, 9.2 ms at 8; CPU time per rank 2.6-3.5 ms at all three).
    None unless ``ddp`` runs with its torch and Lightning variants."""
    ddp = [c for c in cases if c.key == "ddp"]
    if not ddp or "torch" not in roles or "lightning" not in roles:
        return []
    have = {c.world for c in ddp}
    worlds = sorted({c.world for c in cases if c.processes is None} - have)
    return [dataclasses.replace(CASES["ddp"].with_dp(n), loop_cost=True) for n in worlds]


def lightning_name(case: Case, device: str) -> str | None:
    return case.lightning_cuda if device == "cuda" else case.lightning


PRESETS: dict[str, dict[str, Any]] = {
    "default": dict(layers=4, hidden=256, heads=4, seq=128, vocab=256, batch=16, warmup=3, steps=10, reps=3),
    "quick": dict(layers=2, hidden=128, heads=4, seq=64, vocab=256, batch=8, warmup=2, steps=5, reps=3),
    # ~3.0B parameters: 48 GB of fp32 AdamW model states under lp_ddp plus activations, sized for 80 GB GPUs
    "large": dict(layers=24, hidden=3072, heads=24, seq=1024, vocab=50304, batch=8, warmup=3, steps=10, reps=3),
}
SIZE_KEYS = ("layers", "hidden", "heads", "seq", "vocab", "batch", "warmup", "steps", "reps")
