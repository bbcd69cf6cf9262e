"""The typed, closed ``parallel`` section shared by strategies, recipes and the planner.

A layout is one point in ``(data_parallel_size, pipeline_parallel_size, tensor_parallel_size, zero_stage,
offload)``; every process-based strategy of the library is a preset of it (``lp_ddp`` is ``(N, 1, 1, 0)``, the
multi-node hybrid ``(d, p, t, 1)``). This module holds only the description and the checks that need nothing but the
section itself (cross-field rules). Checks against the world size live in :mod:`lightning_parallel.parallel.dims`,
checks against a model in :func:`check_model_compat`. All of them run before any process is spawned.

Every error is a :class:`LayoutError` (a ``ValueError``) naming the key, the value, the arithmetic and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = [
    "SCHEDULES",
    "ActivationCheckpointing",
    "ContextParallelStyle",
    "LayoutError",
    "MeshOrder",
    "Offload",
    "ParallelConfig",
    "PipelineSchedule",
    "ScheduleInfo",
    "UserInputError",
    "ZeroStage",
    "check_context_compat",
    "check_micro_batches",
    "check_model_compat",
    "unknown_key_message",
]

ZeroStage = Literal[0, 1, 2, 3]
Offload = Literal["none", "cpu", "nvme"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
"""The names of :data:`SCHEDULES` (a test checks that the two agree), as a type for the CLI and type checkers."""
ActivationCheckpointing = Literal["none", "selective", "full"]
MeshOrder = Literal["dp-pp-tp", "pp-dp-tp"]
ContextParallelStyle = Literal["ring", "all_to_all"]
"""How attention runs over the ``cp`` axis: ``ring`` (key/value blocks travel the ring point to point, head-tail load
balancing) or ``all_to_all`` (Ulysses: heads <-> sequence by two all-to-alls around a local attention)."""

_SIZE_KEYS = ("data_parallel_size", "pipeline_parallel_size", "tensor_parallel_size")


@dataclass(frozen=True)
class ScheduleInfo:
    """One schedule of ``parallel.pipeline_schedule``: the torch class that runs it and what it needs."""

    name: str
    torch_class: str
    """Class name in ``torch.distributed.pipelining.schedules``."""
    multi_stage: bool
    """Takes a list of stages per rank (``virtual_pipeline_stages`` chunks), else exactly one."""
    min_chunks: int
    """Smallest ``virtual_pipeline_stages`` it runs with."""
    stage_per_micro_batch: bool
    """Keeps every stage busy only with at least one micro-batch per stage (``num_micro_batches >= p``)."""
    what: str


SCHEDULES: dict[str, ScheduleInfo] = {s.name: s for s in (
    ScheduleInfo("gpipe", "ScheduleGPipe", False, 1, False,
                 "all m forwards, then all m backwards: m micro-batches of activations alive per stage"),
    ScheduleInfo("1f1b", "Schedule1F1B", False, 1, True,
                 "after a warm-up of p - rank forwards, one forward then one backward: at most p micro-batches of "
                 "activations alive per stage, the same bubble as GPipe"),
    ScheduleInfo("interleaved_1f1b", "ScheduleInterleaved1F1B", True, 2, True,
                 "1F1B over v chunks per rank: the bubble shrinks v-fold, p2p traffic grows v-fold"),
    ScheduleInfo("zero_bubble", "ScheduleInterleavedZeroBubble", True, 1, True,
                 "1F1B with each backward split into the input gradient (on the critical path) and the weight "
                 "gradient (deferred into the bubbles)"),
)}
"""Every pipeline schedule the layout accepts, by name: the one source of the names and of their rules (the layout's
checks here, the runtime's torch class in :mod:`lightning_parallel.parallel.pipeline`)."""


def check_micro_batches(schedule: str, *, p: int, m: int) -> str | None:
    """Why ``m`` micro-batches do not run under ``schedule`` on ``p`` ranks (None if they do): torch's interleaved
    schedules run in rounds of ``r = max(1, m // p)`` and need ``m % r == 0``."""
    if not SCHEDULES[schedule].multi_stage or p == 1:
        return None
    rounds = max(1, m // p)
    if m % rounds:
        good = sorted({k for k in range(max(1, m - p), m + p + 1) if k % max(1, k // p) == 0})
        return (f"the {schedule} schedule runs micro-batches in rounds of r = max(1, m // p) = {rounds} and needs "
                f"m % r == 0, but num_micro_batches={m}: {m} % {rounds} = {m % rounds}. Fix: num_micro_batches in "
                f"{good} (a multiple of pipeline_parallel_size={p} always works)")
    return None


class UserInputError(ValueError):
    """A bad input from the user -- a layout, recipe, module, data path, checkpoint or planner value -- refused before
    any process starts; the command line prints its message alone (no traceback) and exits with code 2."""


class LayoutError(UserInputError):
    """A parallel layout, recipe or module that cannot run; raised before any process starts."""


def _nearest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


def unknown_key_message(key: str, *, where: str | None = None) -> str:
    """The refusal of a key that is not a layout key: where it was found, the nearest valid key, all valid keys."""
    valid = ParallelConfig.field_names()
    place = where or f"parallel.{key}"
    return f"{place}: unknown layout key {key!r}.{_nearest(key, valid)} Valid keys: {', '.join(valid)}."


def _check_choice(key: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices or isinstance(value, bool) != any(isinstance(c, bool) for c in choices):
        raise LayoutError(f"parallel.{key}={value!r} is not one of {list(choices)}.")


def _check_positive_int(key: str, value: Any, *, allow_auto: bool = False) -> None:
    if allow_auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = " or 'auto' (the world size divided by the other sizes)" if allow_auto else ""
        raise LayoutError(f"parallel.{key}={value!r} must be a positive integer{extra}.")


@dataclass(frozen=True)
class ParallelConfig:
    """A parallel layout: how the world of ranks is split, and how each rank holds the model.

    World = ``data_parallel_size x pipeline_parallel_size x tensor_parallel_size`` ranks, arranged in the mesh
    ``("dp", "pp", "tp")`` with ``tp`` innermost (neighbouring ranks, inside a node) and ``dp`` or ``pp`` outermost
    as ``mesh_order`` says.
    """

    data_parallel_size: int | Literal["auto"] = "auto"
    """Replicas of the (pipeline x tensor) model group; 'auto' = world size / (pp x tp). Bounds: >= 1."""
    pipeline_parallel_size: int = 1
    """Pipeline stages the layer sequence is split into (vertical split). Bounds: >= 1, <= number of layers."""
    tensor_parallel_size: int = 1
    """Ranks each weight matrix is split across (horizontal split). Bounds: >= 1, divides attention heads."""
    zero_stage: ZeroStage | None = None
    """ZeRO over the dp axis: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters; None (not set) = the
    strategy's preset decides (lp_ddp 0, lp_sharded 2, lp_zero_offload 2). An explicit value runs as written or is
    refused with the fix. Bounds: 0-3."""
    offload: Offload | None = None
    """Where ZeRO-offload keeps optimizer states (and parameters at stage 3): none, cpu or nvme; None (not set) =
    the strategy's preset decides (lp_zero_offload cpu, every other strategy none)."""
    nvme_path: str | None = None
    """Folder for NVMe offload; required when offload='nvme'."""
    data_parallel_shard_size: int | None = None
    """HSDP: the dp ranks each FSDP2 shard group spans (shard inside, replicate across): dp = replicate x shard, the
    mesh's dp axis splits into ``dp_replicate`` x ``dp_shard``. None = the whole dp axis (plain FSDP / ZeRO). Bounds:
    >= 1, divides data_parallel_size; needs zero_stage 2 or 3; on several nodes it should not exceed a node."""
    reshard_after_forward: bool | Literal["auto"] = "auto"
    """FSDP2 (zero_stage 2 or 3): free the gathered parameters after each forward (true: least memory, an all-gather
    again in backward) or keep them to the backward (false: ZeRO-2's traffic). 'auto': zero_stage 3 reshards, 2 does
    not; in a pipeline the last stage does not either under the 1F1B-family schedules, where each micro-batch's
    backward follows its forward at once."""
    reduce_each_batch: bool = False
    """With gradient accumulation under ZeRO-2/3 (``lp_sharded``; ``lp_tensor``'s FSDP2 over dp): reduce each batch's
    gradient to its shards during that batch's backward, so that only the gradient shard is kept between the batches
    of a step (DeepSpeed's ZeRO-2, FSDP2 left syncing), at one reduction per batch instead of one per step. False:
    one reduction per step, after its last batch; every batch before it keeps the whole local gradient. Needs
    zero_stage 2 or 3, no pipeline and no offload (a pipeline's schedule and the offload engine reduce each batch
    anyway)."""
    num_micro_batches: int | None = None
    """Micro-batches per pipeline step; None = pipeline_parallel_size. Bounds: >= 1 (>= pp for 1F1B schedules)."""
    pipeline_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b (needs virtual_pipeline_stages >= 2) or zero_bubble."""
    virtual_pipeline_stages: int = 1
    """Model chunks per pipeline rank (v of interleaved 1F1B; bubble (p-1)/(v*m)). Bounds: >= 1."""
    pipeline_stage_layers: tuple[int, ...] | None = None
    """Layers of ``pipeline_layers()`` in each of the ``p x v`` stages, in order (e.g. ``[3, 3]``); None = balanced
    by parameter count. Bounds: p x v positive counts summing to the module's pipeline layers."""
    sequence_parallel: bool = False
    """Shard layer norms and dropout along the sequence dim over the tp axis; needs tensor_parallel_size > 1."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """Recompute activations in backward: none, selective (attention core) or full (every block)."""
    compile: bool | str = False
    """torch.compile each block (the module's ``full_checkpointing_modules()``: the transformer blocks) inside the
    composition, after the tensor plan and recomputation and before the data-parallel wrap; true = the default
    backend (inductor), a string names another (e.g. ``aot_eager``)."""
    collective_timeout: int | None = None
    """Seconds a collective may wait for a peer before the run fails with the stuck rank named; None = the
    strategy's ``timeout`` argument when given, else 600 s on CPU (gloo) and Lightning's 30 minutes on accelerators.
    Bounds: >= 1."""
    global_batch_size: int | None = None
    """Samples per optimizer step, kept whatever the data-parallel size: ``trainer.accumulate_grad_batches`` is set to
    ``global_batch_size / (batch_size x dp)`` when the run starts (the data module's ``batch_size`` is per rank), and
    a world where that is not a whole number is refused before any rank starts. None = no rule (the global batch is
    batch_size x dp x accumulate_grad_batches as set). For elastic runs, whose dp changes with the nodes
    (docs/elastic.md). Bounds: >= 1."""
    mesh_order: MeshOrder = "dp-pp-tp"
    """Order of the mesh axes, outermost first; tp is always innermost (inside a node). dp-pp-tp: data-parallel
    replicas outermost (across nodes); pp-dp-tp: pipeline stages outermost, so that on several nodes only the
    point-to-point activations cross nodes and the dp gradient exchange stays inside a node (Megatron, torchtitan).
    The rank arithmetic of both: :mod:`lightning_parallel.parallel.dims`."""
    context_parallel_size: int = 1
    """Context parallelism (``cp``): ranks each sequence is split across (each holds ``s/cp`` tokens, in two chunks:
    head and tail); attention runs over the cp group as ``context_parallel_style`` says. The cp axis sits just
    outside tp (next to it, inside a node); world = dp x cp x pp x tp. cp ranks of a replica read the same batch and
    their gradients are averaged over dp x cp. Bounds: >= 1; the sequence length divisible by 2 x cp."""
    context_parallel_style: ContextParallelStyle = "ring"
    """``ring`` (default: key/value blocks passed around the cp ranks point to point, exact online-softmax merge,
    head-tail load balancing) or ``all_to_all`` (Ulysses: needs the attention heads of a rank, n_head / tp,
    divisible by cp)."""

    def __post_init__(self) -> None:
        if isinstance(self.pipeline_stage_layers, list):  # a recipe's YAML list
            object.__setattr__(self, "pipeline_stage_layers", tuple(self.pipeline_stage_layers))
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | ParallelConfig | None) -> ParallelConfig:
        """Build from a mapping (a recipe's ``parallel`` section); unknown keys are refused with the nearest name."""
        if data is None:
            return cls()
        if isinstance(data, ParallelConfig):
            return data
        if not isinstance(data, Mapping):
            raise LayoutError(f"the parallel section must be a mapping of keys to values, got {type(data).__name__}.")
        unknown = [k for k in data if k not in cls.field_names()]
        if unknown:
            raise LayoutError(unknown_key_message(str(unknown[0])))
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.field_names()}

    def replace(self, **changes: Any) -> ParallelConfig:
        return ParallelConfig.from_dict({**self.to_dict(), **changes})

    # ------------------------------------------------------------------ rules
    @property
    def zero(self) -> int:
        """The ZeRO stage with "not set" read as 0 (what the cross-field rules and the arithmetic use)."""
        return int(self.zero_stage) if self.zero_stage is not None else 0

    @property
    def offload_device(self) -> str:
        """The offload target with "not set" read as ``none``."""
        return self.offload if self.offload is not None else "none"

    @property
    def runs_fsdp2(self) -> bool:
        """Whether this layout's data-parallel engine is FSDP2: ZeRO-3, and ZeRO-2 inside pipeline stages or under
        HSDP (``data_parallel_shard_size``); otherwise DDP or the flat ZeRO-1/2 shards, or DeepSpeed's engine with
        offload."""
        if self.offload_device != "none":
            return False
        shard, dp = self.data_parallel_shard_size, self.data_parallel_size
        hsdp = shard is not None and (not isinstance(dp, int) or shard < dp)
        return self.zero == 3 or (self.zero == 2 and (self.pipeline_parallel_size > 1 or hsdp))

    def with_preset(self, *, zero_stage: int | None = None, offload: str | None = None) -> ParallelConfig:
        """This layout with the keys it leaves unset (None) filled by a strategy's preset; set keys are kept."""
        changes: dict[str, Any] = {}
        if self.zero_stage is None and zero_stage is not None:
            changes["zero_stage"] = zero_stage
        if self.offload is None and offload is not None:
            changes["offload"] = offload
        return self.replace(**changes) if changes else self

    @property
    def micro_batches(self) -> int:
        """Micro-batches per pipeline step, with the default resolved."""
        return self.num_micro_batches if self.num_micro_batches is not None else self.pipeline_parallel_size

    def validate(self) -> None:
        """Check types, bounds and cross-field rules that need nothing but this section."""
        _check_positive_int("data_parallel_size", self.data_parallel_size, allow_auto=True)
        _check_positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        _check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _check_positive_int("virtual_pipeline_stages", self.virtual_pipeline_stages)
        if self.collective_timeout is not None:
            _check_positive_int("collective_timeout", self.collective_timeout)
        if self.global_batch_size is not None:
            _check_positive_int("global_batch_size", self.global_batch_size)
        if self.num_micro_batches is not None:
            _check_positive_int("num_micro_batches", self.num_micro_batches)
        if self.zero_stage is not None:
            _check_choice("zero_stage", self.zero_stage, get_args(ZeroStage))
        if self.offload is not None:
            _check_choice("offload", self.offload, get_args(Offload))
        _check_choice("pipeline_schedule", self.pipeline_schedule, tuple(SCHEDULES))
        _check_choice("activation_checkpointing", self.activation_checkpointing, get_args(ActivationCheckpointing))
        _check_choice("sequence_parallel", self.sequence_parallel, (True, False))
        if not isinstance(self.compile, (bool, str)) or self.compile == "":
            raise LayoutError(
                f"parallel.compile={self.compile!r} must be true, false or the name of a torch.compile backend "
                "(e.g. 'inductor', 'aot_eager'). Fix: compile=true."
            )
        _check_positive_int("context_parallel_size", self.context_parallel_size)
        _check_choice("context_parallel_style", self.context_parallel_style, get_args(ContextParallelStyle))
        if self.mesh_order not in get_args(MeshOrder):
            raise LayoutError(
                f"parallel.mesh_order={self.mesh_order!r} is not a mesh order: tp is always innermost (tensor-parallel "
                "peers share a node), so the orders are 'dp-pp-tp' (dp outermost, the default) and 'pp-dp-tp' (pp "
                "outermost: on several nodes only pipeline activations cross nodes). Fix: mesh_order='dp-pp-tp' or "
                "mesh_order='pp-dp-tp'."
            )
        self._validate_zero()
        self._validate_fsdp()
        self._validate_pipeline()
        self._validate_context()
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise LayoutError(
                "parallel.sequence_parallel=True shards activations over the tp axis, but tensor_parallel_size=1. "
                "Fix: set tensor_parallel_size >= 2 or sequence_parallel=False."
            )

    def _validate_zero(self) -> None:
        pp, z, offload = self.pipeline_parallel_size, self.zero, self.offload_device
        if offload != "none" and self.zero_stage is not None and z < 2:
            raise LayoutError(
                f"parallel.offload={offload!r} needs ZeRO stage 2 or 3, but zero_stage={z}. "
                "Fix: zero_stage=2 (optimizer offload) or zero_stage=3 (optimizer and parameter offload)."
            )
        if offload != "none" and (pp > 1 or self.tensor_parallel_size > 1):
            fix = "pipeline_parallel_size=1" if self.tensor_parallel_size == 1 else "set both to 1"
            raise LayoutError(
                f"parallel.offload={offload!r} runs on the DeepSpeed engine, which here is data parallel only, "
                f"but pipeline_parallel_size={pp} and tensor_parallel_size={self.tensor_parallel_size}. "
                f"Fix: {fix}, or offload='none' (ZeRO-2/3 without offload run inside pipelines as FSDP2)."
            )
        if offload == "nvme" and not self.nvme_path:
            raise LayoutError("parallel.offload='nvme' needs parallel.nvme_path (a folder on a fast local disk).")
        if self.nvme_path and self.offload is not None and offload != "nvme":
            raise LayoutError(
                f"parallel.nvme_path={self.nvme_path!r} is only used with offload='nvme', but offload="
                f"{offload!r}. Fix: set offload='nvme' or remove nvme_path."
            )

    def _validate_fsdp(self) -> None:
        shard, z = self.data_parallel_shard_size, self.zero
        if shard is not None:
            _check_positive_int("data_parallel_shard_size", shard)
            if self.zero_stage is not None and z < 2:
                raise LayoutError(
                    f"parallel.data_parallel_shard_size={shard} shards the model states over FSDP2 groups of {shard} "
                    f"dp ranks (HSDP), but zero_stage={z} shards nothing of the parameters or gradients. Fix: "
                    "zero_stage=3 (or 2), or remove data_parallel_shard_size."
                )
            if isinstance(self.data_parallel_size, int) and self.data_parallel_size % shard:
                raise LayoutError(
                    f"parallel.data_parallel_shard_size={shard} does not divide data_parallel_size="
                    f"{self.data_parallel_size}: {self.data_parallel_size} % {shard} = "
                    f"{self.data_parallel_size % shard} (dp = replicate x shard). Fix: a divisor of "
                    f"{self.data_parallel_size}, e.g. {_largest_divisor(self.data_parallel_size, shard)}."
                )
            if self.offload_device != "none":
                raise LayoutError(
                    f"parallel.data_parallel_shard_size={shard} (HSDP, FSDP2) with offload={self.offload_device!r} "
                    "(the DeepSpeed engine): the two do not combine. Fix: remove one of them."
                )
        if self.reshard_after_forward not in ("auto", True, False):
            raise LayoutError(f"parallel.reshard_after_forward={self.reshard_after_forward!r} is not one of "
                              "['auto', True, False].")
        if self.reshard_after_forward != "auto" and self.zero_stage is not None and z < 2:
            raise LayoutError(
                f"parallel.reshard_after_forward={self.reshard_after_forward} is an FSDP2 setting (zero_stage 2 or "
                f"3), but zero_stage={z}. Fix: remove reshard_after_forward, or zero_stage=3."
            )
        self._validate_reduce_each_batch(z)

    def _validate_reduce_each_batch(self, z: int) -> None:
        if not isinstance(self.reduce_each_batch, bool):
            raise LayoutError(f"parallel.reduce_each_batch={self.reduce_each_batch!r} must be true or false.")
        if not self.reduce_each_batch:
            return
        why = (f"zero_stage={z}: DDP and ZeRO-1 keep the whole gradient anyway" if self.zero_stage is not None
               and z < 2 else f"pipeline_parallel_size={self.pipeline_parallel_size}: a pipeline's schedule reduces "
               "at the end of each batch already" if self.pipeline_parallel_size > 1 else
               f"offload={self.offload_device!r}: the offload engine reduces each batch already"
               if self.offload_device != "none" else None)
        if why is not None:
            raise LayoutError(f"parallel.reduce_each_batch=true shards the gradient of each accumulated batch under "
                              f"ZeRO-2/3, but {why}. Fix: remove reduce_each_batch"
                              + (", or zero_stage=2 or 3 under lp_sharded (3 under lp_tensor)." if "zero_stage" in why
                                 else "."))

    def _validate_pipeline(self) -> None:
        pp, m, v = self.pipeline_parallel_size, self.micro_batches, self.virtual_pipeline_stages
        sched, info = self.pipeline_schedule, SCHEDULES[self.pipeline_schedule]
        if v < info.min_chunks:
            raise LayoutError(
                f"parallel.pipeline_schedule={sched!r} needs virtual_pipeline_stages >= {info.min_chunks} (model "
                f"chunks per rank), got {v}. Fix: virtual_pipeline_stages={info.min_chunks}, or "
                "pipeline_schedule='1f1b'."
            )
        if v > 1 and not info.multi_stage:
            chunked = " and ".join(name for name, s in SCHEDULES.items() if s.multi_stage)
            raise LayoutError(
                f"parallel.virtual_pipeline_stages={v} is only used by the {chunked} schedules, but "
                f"pipeline_schedule={sched!r}. Fix: virtual_pipeline_stages=1 or pipeline_schedule='interleaved_1f1b'."
            )
        if v > 1 and pp == 1:
            raise LayoutError(
                f"parallel.virtual_pipeline_stages={v} needs pipeline_parallel_size >= 2, got 1. "
                "Fix: virtual_pipeline_stages=1."
            )
        if pp > 1 and info.stage_per_micro_batch and m < pp:
            raise LayoutError(
                f"parallel.num_micro_batches={m} < pipeline_parallel_size={pp}: the {sched} schedule keeps every "
                f"stage busy only with at least one micro-batch per stage (bubble (p-1)/m = {pp - 1}/{m}). "
                f"Fix: num_micro_batches >= {pp} (for example {2 * pp}) or pipeline_schedule='gpipe'."
            )
        why = check_micro_batches(sched, p=pp, m=m)
        if why:
            raise LayoutError(f"parallel.num_micro_batches={m}: {why}.")
        layers = self.pipeline_stage_layers
        if layers is not None:
            shown = list(layers) if isinstance(layers, tuple) else layers
            bad = [c for c in layers if isinstance(c, bool) or not isinstance(c, int) or c < 1] if isinstance(
                layers, tuple) else []
            if bad:
                raise LayoutError(
                    f"parallel.pipeline_stage_layers={shown!r}: {bad[0]!r} is not a positive layer count (every "
                    "stage holds at least one layer). Fix: give each stage at least 1 layer, or remove the key to "
                    "balance the stages by parameter count."
                )
            if not isinstance(layers, tuple) or len(layers) != pp * v:
                raise LayoutError(
                    f"parallel.pipeline_stage_layers={shown!r} must list one positive layer count per stage: "
                    f"pipeline_parallel_size={pp} x virtual_pipeline_stages={v} = {pp * v} counts, got "
                    f"{len(layers) if isinstance(layers, tuple) else 'not a list'}. Fix: give {pp * v} counts, or "
                    "remove it to balance the stages by parameter count."
                )
        if self.num_micro_batches is not None and pp == 1 and self.num_micro_batches > 1:
            raise LayoutError(
                f"parallel.num_micro_batches={self.num_micro_batches} splits batches for a pipeline, but "
                "pipeline_parallel_size=1. Fix: remove num_micro_batches, or use gradient accumulation "
                "(trainer.accumulate_grad_batches) for the same effect without a pipeline."
            )

    def _validate_context(self) -> None:
        cp = self.context_parallel_size
        if cp > 1 and self.offload_device != "none":
            raise LayoutError(
                f"parallel.context_parallel_size={cp} with offload={self.offload_device!r}: offload runs on the "
                "DeepSpeed engine, which here is data parallel only and does not split sequences. Fix: "
                "context_parallel_size=1, or offload='none' (ZeRO-3 over dp x cp shards the model states instead)."
            )
        if self.context_parallel_style != "ring" and cp == 1:
            raise LayoutError(
                f"parallel.context_parallel_style={self.context_parallel_style!r} is used only with "
                "context_parallel_size >= 2, got 1. Fix: set context_parallel_size, or remove context_parallel_style."
            )

    def describe(self) -> str:
        """A short human-readable form, e.g. ``dp=auto pp=1 tp=1 zero=0`` (``zero=preset``: not set)."""
        zero = "preset" if self.zero_stage is None else str(self.zero_stage)
        text = (
            f"dp={self.data_parallel_size} pp={self.pipeline_parallel_size} "
            f"tp={self.tensor_parallel_size} zero={zero}"
        )
        if self.offload is not None and self.offload != "none":
            text += f" offload={self.offload}"
        if self.activation_checkpointing != "none":
            text += f" recompute={self.activation_checkpointing}"
        if self.data_parallel_shard_size is not None:
            text += f" shard={self.data_parallel_shard_size}"
        if self.reduce_each_batch:
            text += " reduce_each_batch"
        if self.compile:
            text += " compile" if self.compile is True else f" compile={self.compile}"
        if self.mesh_order != "dp-pp-tp":
            text += f" order={self.mesh_order}"
        if self.context_parallel_size > 1:
            text += f" cp={self.context_parallel_size}"
            if self.context_parallel_style != "ring":
                text += f" cp_style={self.context_parallel_style}"
        return text


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def check_model_compat(
    config: ParallelConfig, *, n_layer: int | None = None, n_head: int | None = None, vocab_size: int | None = None,
    sequence_length: int | None = None,
) -> None:
    """Rules that tie a layout to a model's shape: heads % tp, layers >= pp x v, vocab % tp; with cp > 1 the
    sequence length % (2 x cp) and, for ``context_parallel_style: all_to_all``, (heads / tp) % cp.

    Raised before launch, with the arithmetic and the fix.
    """
    tp, pp, v = config.tensor_parallel_size, config.pipeline_parallel_size, config.virtual_pipeline_stages
    check_context_compat(config, n_head=n_head, sequence_length=sequence_length)
    if n_head is not None and n_head % tp:
        divisors = [d for d in range(1, n_head + 1) if n_head % d == 0]
        raise LayoutError(
            f"parallel.tensor_parallel_size={tp} does not divide the model's attention heads: n_head={n_head}, "
            f"{n_head} % {tp} = {n_head % tp}. Fix: tensor_parallel_size in {divisors}, or change n_head."
        )
    if vocab_size is not None and vocab_size % tp:
        raise LayoutError(
            f"parallel.tensor_parallel_size={tp} does not divide the vocabulary: vocab_size={vocab_size}, "
            f"{vocab_size} % {tp} = {vocab_size % tp}. Fix: pad vocab_size to {-(-vocab_size // tp) * tp}, the next "
            f"multiple of {tp} (the extra embedding rows and logits are never targets)."
        )
    if n_layer is not None and pp * v > n_layer:
        raise LayoutError(
            f"parallel.pipeline_parallel_size={pp} x virtual_pipeline_stages={v} = {pp * v} stages, but the model "
            f"has only n_layer={n_layer} layers to split. Fix: pipeline_parallel_size x virtual_pipeline_stages "
            f"<= {n_layer}."
        )


def check_context_compat(config: ParallelConfig, *, n_head: int | None = None, sequence_length: int | None = None,
                         where: str = "the sequence length") -> None:
    """The context-parallel rules of a model or batch: the sequence length divisible by ``2 x cp`` (each cp rank
    holds two chunks of ``s / (2 cp)`` tokens: chunk ``r`` and chunk ``2 cp - 1 - r``, so the causal work is
    balanced) and, for ``all_to_all``, each rank's heads (``n_head / tp``) divisible by cp (the all-to-all gives
    every cp rank ``n_head / (tp x cp)`` whole heads over the whole sequence). No rule at cp = 1."""
    cp, tp = config.context_parallel_size, config.tensor_parallel_size
    if cp == 1:
        return
    if sequence_length is not None and sequence_length % (2 * cp):
        below = sequence_length - sequence_length % (2 * cp)
        good = [k for k in (below, below + 2 * cp) if k > 0]
        raise LayoutError(
            f"parallel.context_parallel_size={cp} splits each sequence into 2 x cp = {2 * cp} chunks (head and tail "
            f"per rank), but {where} is {sequence_length}: {sequence_length} % {2 * cp} = "
            f"{sequence_length % (2 * cp)}. Fix: a sequence length that is a multiple of {2 * cp} (e.g. "
            f"{' or '.join(str(k) for k in good)}), or context_parallel_size in "
            f"{[c for c in range(1, sequence_length // 2 + 1) if sequence_length % (2 * c) == 0][:6]}."
        )
    if n_head is not None and config.context_parallel_style == "all_to_all" and (n_head // max(tp, 1)) % cp:
        local = n_head // max(tp, 1)
        raise LayoutError(
            f"parallel.context_parallel_style='all_to_all' gives each of the cp={cp} ranks whole heads over the "
            f"whole sequence, so the heads of a rank must divide by cp: n_head={n_head} / tensor_parallel_size={tp} "
            f"= {local} heads, {local} % {cp} = {local % cp}. Fix: context_parallel_style='ring' (no heads rule), "
            f"or context_parallel_size in {[c for c in range(1, local + 1) if local % c == 0]}."
        )
