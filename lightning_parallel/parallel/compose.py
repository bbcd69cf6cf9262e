"""One composition, in one fixed order, for every process-based layout strategy.

``lp_ddp``, ``lp_sharded`` (ZeRO 1/2/3), ``lp_tensor``, ``lp_pipeline`` and ``lp_hybrid`` are presets of
:func:`compose`, which turns the whole module into what one rank of the ``(dp, pp, tp)`` mesh runs, in this order
(:data:`COMPOSITION_ORDER`):

1. **pipeline split** (pp > 1): the module's ``pipeline_layers()`` are cut into ``pp x v`` stages
   (:mod:`lightning_parallel.parallel.pipeline`); this rank's copy keeps only its stages' layers, under the whole
   model's names;
2. **placement**: the module (what is left of it) moves to the rank's device, or a meta-device module is
   materialized there with its ``init_weights()`` -- after the split, so a rank allocates only what it keeps;
3. **tensor plan** (tp > 1): the module's ``tensor_parallel_plan()`` splits the present layers over ``tp``
   (DTensor shards; entries naming other stages' layers are skipped);
4. **context parallel** (cp > 1): the attention submodules of the module's ``context_parallel_plan()`` run ring
   (or all-to-all) attention over ``cp`` (a class swap: names unchanged; :mod:`.context_parallel`), and the process's
   cp state is set (this rank's head-tail chunks, positions); batches are split at step time by the strategy;
5. **activation checkpointing** (``parallel.activation_checkpointing``): recompute the named submodules in backward
   (a class swap: names unchanged, the TP hooks stay on the submodules; a recomputed attention core recomputes its
   ring);
6. **compile** (``parallel.compile``): ``torch.compile`` each block in place (:mod:`lightning_parallel.parallel.
   compile`), so the graphs see the TP shards and the recomputation and the dp wrap goes around them (torchtitan's
   order);
7. **data-parallel wrap** over the model's replicas -- ``dp``, or ``dp x cp`` (the mesh's ``dp_cp``) with context
   parallelism: cp ranks hold the same weights and their gradients are averaged with the dp replicas' -- as
   :func:`data_parallel_plan` decides from the layout:

   ========== =========================================== ==============================================
   sync       layouts                                     what the wrap does (the step's part: step.py)
   ========== =========================================== ==============================================
   ddp        ``(N,1,1,0)``                               torch DDP (fit); bucketed all-reduce in backward
   allreduce  zero 0 with pp or tp > 1                    broadcast; one flat all-reduce at the step's end
   zero       zero 1/2 (ZeRO-1 also with pp, tp)          broadcast; reduce-scatter + all-gather by the optimizer
   fsdp       zero 3; zero 2 in a pipeline or HSDP      broadcast, then FSDP2 ``fully_shard`` over ``dp``
                                                          (or ``(dp_replicate, dp_shard)``), per pipeline stage
   fairscale  lp_sharded's fairscale backend, zero 1/2    DDP (zero 1) or broadcast (zero 2: SDP with the optimizer)
   ========== =========================================== ==============================================

Each step is a public function that records itself on the module; a step called after a later one (a tensor plan
on a module already wrapped for data parallelism, a split after a tensor plan, any step twice) raises
:class:`CompositionOrderError`, so the order cannot change by accident. The step-time work of the data-parallel
axis (accumulation, the dp gradient sync, ZeRO's optimizer, clipping over every axis, the logged loss) is
:mod:`lightning_parallel.parallel.step`'s. No Lightning import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.config import LayoutError, ParallelConfig
from lightning_parallel.parallel.dims import ParallelDims

from .context_parallel import ContextParallelPlan, ContextParallelState, SequenceShard, activate, active
from .pipeline import StageChunk, StagePlan, has_meta_tensors, materialize, plan_stages, prune_to

__all__ = ["COMPOSITION_ORDER", "Composition", "CompositionOrderError", "DataParallelPlan", "DataParallelSync",
           "apply_compile", "apply_context_parallel_step", "apply_recomputation", "apply_tensor_plan", "compose",
           "composition_of", "composition_path", "data_parallel_plan", "ddp_wrapper", "place", "reshard_policy",
           "rewrap_if_trainable_changed", "split_pipeline", "steps_done", "wrap_data_parallel"]

COMPOSITION_ORDER = ("pipeline split", "placement", "tensor plan", "context parallel", "activation checkpointing",
                     "compile",
                     "data-parallel wrap")
"""The steps of :func:`compose`, in the only order they may run."""

DataParallelSync = Literal["ddp", "allreduce", "zero", "fsdp", "fairscale"]
ShardingBackend = Literal["native", "fairscale"]

_STEPS_DONE = "_lp_composition_steps"
_COMPOSITION = "_lp_composition"
_BUILT_TRAINABLE = "_lp_built_trainable"  # on a DDP wrapper: its module's parameters, and which required gradients


class CompositionOrderError(RuntimeError):
    """A composition step applied out of :data:`COMPOSITION_ORDER` (or twice) -- an internal error."""


@dataclass(frozen=True)
class DataParallelPlan:
    """How replicas over ``dp`` are made and kept equal (module docstring's table)."""

    sync: DataParallelSync
    zero_stage: int
    ddp_options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of torch DDP (``bucket_cap_mb``, ``static_graph``, ...) for ``sync="ddp"``."""
    reshard_after_forward: bool | None = None
    """FSDP2 (``sync="fsdp"``): free gathered parameters after forward; None = per stage (:func:`reshard_policy`)."""
    hsdp: bool = False
    """FSDP2 over the 2-D ``(dp_replicate, dp_shard)`` mesh: shard inside a group, all-reduce across groups."""
    param_dtype: torch.dtype | None = None
    """``sync="fsdp"``: the dtype FSDP2 all-gathers and computes the parameters in (None: their own); the
    strategies set bf16 under ``bf16-mixed`` (FSDP2's ``MixedPrecisionPolicy``)."""
    reduce_dtype: torch.dtype | None = None
    """``sync="fsdp"``: the dtype the gradients are reduce-scattered in (None: ``param_dtype``'s)."""
    axis: str = "dp"
    """The mesh dim of the replicas the plan keeps equal: ``dp``, or ``dp_cp`` with context parallelism."""
    reduce_each_batch: bool = False
    """ZeRO-2/3 (``sync`` "zero" at stage 2, "fsdp"): every accumulated batch's backward reduces its gradient to the
    shards (``parallel.reduce_each_batch``); False: the step's last batch reduces the sum."""
    fsdp_axes: tuple[str, ...] = ("dp",)
    """The mesh dims FSDP2 shards over (``sync="fsdp"``): ``(axis,)``, or HSDP's ``(dp_replicate, dp_shard)``
    (``dp_shard_cp`` with context parallelism)."""

    @property
    def wraps_module(self) -> bool:
        """True when fitting puts a torch wrapper (DDP) around the module: its ``no_sync`` defers the dp sync."""
        return self.sync == "ddp" or (self.sync == "fairscale" and self.zero_stage == 1)


def data_parallel_plan(layout: ParallelConfig, dims: ParallelDims, *, backend: ShardingBackend = "native",
                       ddp_options: Mapping[str, Any] | None = None) -> DataParallelPlan:
    """The data-parallel wrap and step sync of ``layout`` (its ``zero_stage`` read with "unset" as 0).

    ZeRO-3 is FSDP2 everywhere (over TP shards, inside pipeline stages, HSDP). ZeRO-2 is the flat-shard optimizer
    for plain data parallelism and FSDP2 without resharding after forward where that optimizer cannot go (inside
    pipeline stages, whose micro-batches add into the whole gradient of the step; under HSDP): parameters gathered
    once per step, gradients reduce-scattered once per step -- ZeRO-2's traffic.
    """
    plan = _data_parallel_plan(layout, dims, backend=backend, ddp_options=ddp_options)
    if layout.reduce_each_batch:
        if plan.zero_stage < 2 or plan.sync == "fairscale" or dims.pp > 1:
            raise LayoutError(
                f"parallel.reduce_each_batch=true shards each accumulated batch's gradient under ZeRO-2/3 (lp_sharded, "
                f"lp_tensor's FSDP2), but this layout runs zero_stage={plan.zero_stage} with backend {backend!r} and "
                f"pipeline_parallel_size={dims.pp}. Fix: remove reduce_each_batch, or zero_stage=2 or 3 with the "
                "native backend and no pipeline (lp_sharded; lp_tensor at 3).")
        plan = replace(plan, reduce_each_batch=True)
    if dims.cp == 1:
        return plan
    if plan.sync == "fairscale":
        raise LayoutError(f"the fairscale backend runs over the dp group alone, but context_parallel_size={dims.cp} "
                          "averages gradients over dp x cp. Fix: backend='native'.")
    return replace(plan, axis=dims.replica_axis, fsdp_axes=dims.fsdp_axes)


def _data_parallel_plan(layout: ParallelConfig, dims: ParallelDims, *, backend: ShardingBackend,
                        ddp_options: Mapping[str, Any] | None) -> DataParallelPlan:
    zero = layout.zero
    reshard = None if layout.reshard_after_forward == "auto" else bool(layout.reshard_after_forward)
    if dims.hsdp and zero < 2:
        raise LayoutError(
            f"parallel.data_parallel_shard_size={dims.dp_shard} (HSDP over FSDP2) needs zero_stage 2 or 3, but "
            f"zero_stage={zero}. Fix: zero_stage=3 (or 2), or remove data_parallel_shard_size.")
    if backend == "fairscale":
        if zero not in (1, 2) or dims.pp > 1 or dims.tp > 1 or dims.hsdp:
            raise LayoutError(f"the fairscale backend runs ZeRO stage 1 or 2 over dp alone, got zero_stage={zero}, "
                              f"pp={dims.pp}, tp={dims.tp}, data_parallel_shard_size={dims.dp_shard}. "
                              "Fix: backend='native'.")
        return DataParallelPlan("fairscale", zero)
    fsdp = ("dp_replicate", "dp_shard") if dims.hsdp else ("dp",)
    if zero == 3:
        return DataParallelPlan("fsdp", 3, reshard_after_forward=reshard, hsdp=dims.hsdp, fsdp_axes=fsdp)
    if zero == 2:
        if dims.tp > 1 and dims.pp == 1:
            raise LayoutError(
                f"parallel.zero_stage=2 with tensor_parallel_size={dims.tp} and no pipeline is not composed: "
                "zero_stage=1 moves the same bytes (the gradients stay whole), zero_stage=3 shards the parameters "
                "too. Fix: zero_stage=1 or 3.")
        if dims.pp > 1 or dims.hsdp:
            return DataParallelPlan("fsdp", 2, reshard_after_forward=False if reshard is None else reshard,
                                    hsdp=dims.hsdp, fsdp_axes=fsdp)
        return DataParallelPlan("zero", 2)
    if zero == 1:
        return DataParallelPlan("zero", 1)
    if dims.pp == 1 and dims.tp == 1:
        return DataParallelPlan("ddp", 0, dict(ddp_options or {}))
    return DataParallelPlan("allreduce", 0)


def reshard_policy(plan: DataParallelPlan, *, stage: int | None, num_stages: int, schedule: str) -> bool:
    """FSDP2's ``reshard_after_forward`` for one FSDP root (the whole module, or pipeline stage ``stage``).

    Set in the layout, it is used as set. ``auto``: ZeRO-2 never reshards (parameters gathered once per step);
    ZeRO-3 reshards (memory: only one unit's parameters gathered at a time, at the price of an all-gather again in
    backward) -- except on a pipeline's last stage under the 1F1B-family schedules, where each micro-batch's backward
    runs right after its forward, so freeing the parameters in between would only add an all-gather per
    micro-batch; and, without a pipeline, for the unit that runs last in forward (the head), whose backward comes
    first (``apply_zero3(keep_last_gathered=True)``). Inside a pipeline the backward keeps them gathered across
    micro-batches and frees them after the step's last one (torch pipelining defers the reduce-scatter to it).
    """
    if plan.reshard_after_forward is not None:
        return plan.reshard_after_forward
    if plan.zero_stage < 3:
        return False
    last = stage is not None and stage == num_stages - 1
    return not (last and schedule != "gpipe")


@dataclass
class Composition:
    """What :func:`compose` did to the module on this rank, and what the loops call."""

    data_parallel: DataParallelPlan
    module: nn.Module
    """What the loops run: the torch DDP wrapper when fitting under ``sync="ddp"``, else the module itself."""
    key: tuple[Any, ...] = ()
    """The layout, degrees, rank and backend composed for (a second :func:`compose` with the same key reuses it)."""
    stage_plan: StagePlan | None = None
    """The cut of the whole model into stages (None without a pipeline)."""
    chunks: list[StageChunk] = field(default_factory=list)
    """This rank's stages, in order (empty without a pipeline)."""
    tensor_plan: dict[str, Any] = field(default_factory=dict)
    """The expanded tensor-parallel plan applied here (empty without TP)."""
    recomputed: list[str] = field(default_factory=list)
    """Submodules recomputed in backward."""
    compiled: list[str] = field(default_factory=list)
    """Submodules compiled in place (``parallel.compile``)."""
    context_plan: ContextParallelPlan | None = None
    """The module's context-parallel plan as applied (None without cp): its routed attention, its batch dims."""
    context_state: ContextParallelState | None = None
    """The cp state the composition activated (made active again when the composition is reused)."""

    @property
    def fully_sharded(self) -> bool:
        """FSDP2 over dp (zero_stage 3)."""
        return self.data_parallel.sync == "fsdp"


# ---------------------------------------------------------------------------------------------------- the order
def steps_done(module: nn.Module) -> list[str]:
    """The composition steps applied to ``module`` so far, in order."""
    return list(getattr(module, _STEPS_DONE, []))


def _enter(module: nn.Module, step: str) -> None:
    done = steps_done(module)
    index = COMPOSITION_ORDER.index(step)
    later = [s for s in done if COMPOSITION_ORDER.index(s) >= index]
    if later:
        raise CompositionOrderError(
            f"composition step {step!r} after {later[-1]!r}: the steps run once each, in the order "
            f"{' -> '.join(COMPOSITION_ORDER)} (done here: {done or 'none'})."
        )
    object.__setattr__(module, _STEPS_DONE, [*done, step])


# ---------------------------------------------------------------------------------------------------- the steps
def split_pipeline(module: nn.Module, *, layout: ParallelConfig, dims: ParallelDims,
                   pp_rank: int) -> tuple[StagePlan, list[StageChunk]]:
    """Step 1: cut ``module.pipeline_layers()`` into ``pp x v`` stages and keep only pipeline rank ``pp_rank``'s
    layers in ``module`` (in place, names unchanged). Returns the cut and this rank's stage chunks."""
    _enter(module, "pipeline split")
    layers = module.pipeline_layers()  # type: ignore[operator]
    counts = None if layout.pipeline_stage_layers is None else [int(c) for c in layout.pipeline_stage_layers]
    plan = plan_stages(module, layers, pp=dims.pp, chunks=layout.virtual_pipeline_stages, pp_rank=pp_rank,
                       layers_per_stage=counts)
    return plan, prune_to(module, plan, layers)


def place(module: nn.Module, *, device: torch.device, seed: int) -> None:
    """Step 2: move ``module`` to ``device``, or materialize a meta-device module there with its ``init_weights()``
    after ``torch.manual_seed(seed)``."""
    _enter(module, "placement")
    if has_meta_tensors(module):
        materialize(module, device, seed=seed)
    else:
        module.to(device)


def apply_tensor_plan(module: nn.Module, *, tp_mesh: DeviceMesh, sequence_parallel: bool,
                      skip_missing: bool = False) -> dict[str, Any]:
    """Step 3: split the layers of ``module.tensor_parallel_plan()`` over the 1-D ``tp_mesh`` (Megatron column /
    row / vocab styles, :mod:`lightning_parallel.parallel.tensor`). Returns the expanded plan applied."""
    from lightning_parallel.parallel.tensor import apply_tensor_parallel

    _enter(module, "tensor plan")
    tied = _tied_parameters(module)
    plan = apply_tensor_parallel(module, module.tensor_parallel_plan(),  # type: ignore[operator]
                                 mesh=tp_mesh, sequence_parallel=sequence_parallel, skip_missing=skip_missing)
    _tie_again(module, tied)
    return plan


def _tied_parameters(module: nn.Module) -> list[list[tuple[str, str]]]:
    """The groups of ``(submodule path, attribute)`` that hold one parameter object (tied weights, e.g. a token
    embedding shared with the output head)."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for path, sub in module.named_modules():
        for name, param in sub.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((path, name))
    return [group for group in holders.values() if len(group) > 1]


def _split_of(p: torch.Tensor) -> tuple[Any, tuple[int, ...]]:
    """How the tensor plan left a parameter: its mesh and placements (None for a plain tensor), and its shape."""
    from torch.distributed.tensor import DTensor

    return ((p.device_mesh, tuple(p.placements)) if isinstance(p, DTensor) else "not split", tuple(p.shape))


def _tie_again(module: nn.Module, tied: list[list[tuple[str, str]]]) -> None:
    """After the tensor plan: each tied group holds one parameter again. The plan replaces a layer's parameters by
    DTensor shards layer by layer, so a weight two layers shared became two parameters -- each stepped with its own
    layer's gradient only (the GPT with tied embeddings under tp=2: 1.3e-02 from one device after 4 steps). Where
    the plan split them alike (the same mesh, placements and shape: the GPT's vocabulary-parallel embedding and
    head) the first is put back in every place; otherwise the layout is refused with the layers and the fix."""
    for group in tied:
        params = [module.get_submodule(path).get_parameter(name) for path, name in group]
        first = params[0]
        if all(p is first for p in params):
            continue
        if any(_split_of(p) != _split_of(first) for p in params):
            where = ", ".join(f"{path}.{name}" for path, name in group)
            raise LayoutError(
                f"{where} share one parameter (tied weights), but the tensor plan splits them differently "
                f"({'; '.join(f'{_split_of(p)[0]}, shape {_split_of(p)[1]}' for p in params)}), so the tie would be "
                "lost and each copy "
                "trained on its own layer's gradient. Fix: give these layers the same tensor-parallel style in "
                "tensor_parallel_plan() (e.g. 'vocab' for a token embedding and the output head it is tied to), or "
                "untie them.")
        for (path, name), p in zip(group[1:], params[1:], strict=True):
            if p is not first:
                setattr(module.get_submodule(path), name, first)


def apply_context_parallel_step(module: nn.Module, *, cp_group: Any, shard: SequenceShard, style: str,
                                skip_missing: bool = False) -> ContextParallelPlan:
    """Step 4: route the attention submodules of ``module.context_parallel_plan()`` to ring (``style="ring"``) or
    all-to-all attention over ``cp_group`` and make this rank's ``shard`` the process's cp state
    (:func:`~lightning_parallel.parallel.context_parallel.apply_context_parallel`). Returns the plan."""
    from .context_parallel import apply_context_parallel

    _enter(module, "context parallel")
    return apply_context_parallel(module, group=cp_group, shard=shard, style=style, skip_missing=skip_missing)


def apply_recomputation(module: nn.Module, *, mode: str) -> list[str]:
    """Step 5: recompute activations in backward as ``mode`` (``selective``/``full``) says; returns the names."""
    from lightning_parallel.parallel.activation_checkpointing import apply_activation_checkpointing

    _enter(module, "activation checkpointing")
    return apply_activation_checkpointing(module, mode)


def apply_compile(module: nn.Module, *, setting: bool | str, tensor_plan: dict[str, Any] | None = None) -> list[str]:
    """Step 6: ``torch.compile`` each block in place (``setting``: true or a backend name); returns the names.
    ``tensor_plan``: the plan step 3 applied (its local outputs that enter a compiled block are copied)."""
    from lightning_parallel.parallel.compile import apply_compile as compile_blocks
    from lightning_parallel.parallel.compile import copy_local_outputs_into_compiled

    _enter(module, "compile")
    names = compile_blocks(module, setting)
    if tensor_plan:
        copy_local_outputs_into_compiled(module, tensor_plan, names)
    return names


def wrap_data_parallel(module: nn.Module, *, plan: DataParallelPlan, mesh: DeviceMesh, dp_src: int,
                       fitting: bool, stages: list[tuple[int, nn.Module]] | None = None, num_stages: int = 1,
                       schedule: str = "1f1b") -> nn.Module:
    """Step 7: make the replicas equal and wrap as ``plan`` says; returns what the loops call.

    Every replica's tensors (local TP shards included) := those of global rank ``dp_src`` (the first rank of this
    rank's ``plan.axis`` group: dp, or dp x cp), then: ``fsdp`` -- FSDP2 ``fully_shard`` (in place) over the
    ``plan.fsdp_axes`` sub-mesh (dp; dp x cp; HSDP's ``(dp_replicate, dp_shard)`` or ``(dp_replicate,
    dp_shard_cp)``), with the whole module as the root or, in a pipeline, each of this rank's ``stages``
    (``(stage index, stage module)``) as a root of its own; ``ddp`` (and fairscale stage 1) when fitting -- torch DDP
    over the ``plan.axis`` group (see :func:`ddp_wrapper`).
    """
    from lightning_parallel.parallel.zero.comm import broadcast_module_states

    _enter(module, "data-parallel wrap")
    broadcast_module_states(module, group=mesh.get_group(plan.axis), src_rank=dp_src)
    if plan.sync == "fsdp":
        from lightning_parallel.parallel.zero import apply_zero3

        fsdp_mesh = mesh[plan.fsdp_axes] if len(plan.fsdp_axes) > 1 else mesh[plan.fsdp_axes[0]]
        dtypes: dict[str, Any] = {"param_dtype": plan.param_dtype, "reduce_dtype": plan.reduce_dtype}
        if not stages:  # 'auto': the unit that runs last in forward stays gathered into the backward
            return apply_zero3(module, mesh=fsdp_mesh, reshard_after_forward=reshard_policy(
                plan, stage=None, num_stages=1, schedule=schedule),
                keep_last_gathered=plan.reshard_after_forward is None, **dtypes)
        for index, stage in stages:
            apply_zero3(stage, mesh=fsdp_mesh, reshard_after_forward=reshard_policy(
                plan, stage=index, num_stages=num_stages, schedule=schedule), **dtypes)
        return module
    return ddp_wrapper(module, plan=plan, mesh=mesh) if fitting else module


def ddp_wrapper(module: nn.Module, *, plan: DataParallelPlan, mesh: DeviceMesh) -> nn.Module:
    """The fit-time wrapper of ``plan`` around a composed ``module``: torch DDP over the ``plan.axis`` group (dp, or
    dp x cp) for ``ddp`` and fairscale stage 1 (its constructor broadcasts the group's first rank's weights), else the
    module itself."""
    if not plan.wraps_module:
        return module
    from torch.nn.parallel import DistributedDataParallel

    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    ddp = DistributedDataParallel(module, device_ids=None if device.type == "cpu" else [device.index],
                                  process_group=mesh.get_group(plan.axis), **dict(plan.ddp_options))
    params = list(module.parameters())
    object.__setattr__(ddp, _BUILT_TRAINABLE, (params, [p.requires_grad for p in params]))
    return ddp


def rewrap_if_trainable_changed(model: nn.Module, *, plan: DataParallelPlan, mesh: DeviceMesh) -> nn.Module:
    """``model`` itself, or -- when it is a DDP wrapper made by :func:`ddp_wrapper` and the set of its parameters that
    require gradients has changed since -- a new DDP over the same module.

    torch DDP builds its reducer over the parameters that require gradients when it is constructed and never looks
    again: a parameter made trainable later (Lightning's ``BackboneFinetuning`` unfreezing a backbone frozen before
    the wrap, a callback unfreezing layers) gets its gradient on every rank, never averaged, and each replica steps
    with its own -- the replicas drift apart without an error; a parameter frozen later leaves a bucket that never
    fills. The strategies call this before each training batch (after the callbacks' batch-start hooks). The new
    wrapper's constructor checks the parameter shapes over the group and broadcasts the group's first rank's
    states (equal already), the old one's autograd hooks are removed. Every rank must change the set alike, as a
    callback does. Cost per batch: one read of ``requires_grad`` per parameter."""
    built = getattr(model, _BUILT_TRAINABLE, None)
    if built is None:
        return model
    params, flags = built
    if [p.requires_grad for p in params] == flags:
        return model
    remove = getattr(model, "_remove_autograd_hooks", None)
    if callable(remove):
        remove()
    inner = model.module
    assert isinstance(inner, nn.Module)
    return ddp_wrapper(inner, plan=plan, mesh=mesh)


# ---------------------------------------------------------------------------------------------------- all of it
def composition_of(module: nn.Module) -> Composition | None:
    """The composition an earlier :func:`compose` left on ``module`` (None if it was never composed)."""
    done = getattr(module, _COMPOSITION, None)
    return done if isinstance(done, Composition) else None


def compose(module: nn.Module, *, layout: ParallelConfig, dims: ParallelDims, rank: int, mesh: DeviceMesh,
            device: torch.device, seed: int, data_parallel: DataParallelPlan, fitting: bool = True,
            pipeline: bool | None = None) -> Composition:
    """Turn ``module`` in place into global ``rank``'s part of the layout: the steps of :data:`COMPOSITION_ORDER`.

    Args:
        layout: the resolved layout (schedule, v, stage layer counts, sequence parallel, recomputation, ZeRO stage).
        dims: the degrees; ``rank``: this process's global rank; ``mesh``: the named ``(dp, pp, tp)`` mesh.
        device: where the module runs; ``seed``: what a meta-device module's ``init_weights()`` starts from.
        data_parallel: the dp wrap and step sync (:func:`data_parallel_plan`).
        fitting: wrap for training (torch DDP under ``sync="ddp"``); validate/test/predict run the module itself.
        pipeline: cut into stages (default: ``dims.pp > 1``; a pipeline strategy cuts a one-stage pipeline too).

    A module composed before by this process for the same layout (``fit`` then ``validate``) is reused: only the
    fit-time wrapper is made again. One composed for another layout is refused.
    """
    pipelined = pipeline if pipeline is not None else dims.pp > 1
    key = (layout, dims, rank, data_parallel, pipelined)
    done = composition_of(module)
    if done is not None:
        if done.key != key:
            raise CompositionOrderError(
                f"{type(module).__name__} was composed for another layout on this rank ({done.key[0].describe()}, "
                f"{done.data_parallel.sync}); a module is composed once. Fix: build a fresh module for the new layout."
            )
        done.module = ddp_wrapper(module, plan=data_parallel, mesh=mesh) if fitting else module
        if done.context_state is not None and active() is not done.context_state:
            activate(done.context_state)  # a later fit/validate of this process: the cp state again
        return done
    from lightning_parallel.parallel.compile import unwrap_compiled

    unwrap_compiled(module)  # a submodule the user compiled: names without "_orig_mod." from here on
    out = Composition(data_parallel=data_parallel, module=module, key=key)
    coords = dims.coords(rank)
    for step in composition_path(layout, dims, pipeline=pipelined):
        if step == "pipeline split":
            out.stage_plan, out.chunks = split_pipeline(module, layout=layout, dims=dims, pp_rank=coords.pp)
        elif step == "placement":
            place(module, device=device, seed=seed)
        elif step == "tensor plan":
            out.tensor_plan = apply_tensor_plan(module, tp_mesh=mesh["tp"], sequence_parallel=layout.sequence_parallel,
                                                skip_missing=out.stage_plan is not None)
        elif step == "context parallel":
            shard = SequenceShard(dims.cp, dims.coord(rank, "cp"))
            out.context_plan = apply_context_parallel_step(module, cp_group=mesh.get_group("cp"), shard=shard,
                                                           style=layout.context_parallel_style,
                                                           skip_missing=out.stage_plan is not None)
            out.context_state = active()
        elif step == "activation checkpointing":
            out.recomputed = apply_recomputation(module, mode=layout.activation_checkpointing)
        elif step == "compile":
            out.compiled = apply_compile(module, setting=layout.compile, tensor_plan=out.tensor_plan)
        else:
            stages: list[tuple[int, nn.Module]] | None = None
            if out.stage_plan is not None:
                stages = list(zip(out.stage_plan.my_stages, out.chunks, strict=True))
            out.module = wrap_data_parallel(module, plan=data_parallel, mesh=mesh,
                                            dp_src=dims.replica_group_ranks(rank)[0], fitting=fitting, stages=stages,
                                            num_stages=out.stage_plan.num_stages if out.stage_plan else 1,
                                            schedule=layout.pipeline_schedule)
    object.__setattr__(module, _COMPOSITION, out)
    return out


def composition_path(layout: ParallelConfig, dims: ParallelDims, *, pipeline: bool | None = None) -> tuple[str, ...]:
    """The steps of :data:`COMPOSITION_ORDER` that :func:`compose` applies for ``layout`` (in that order): the
    split with a pipeline, placement always, the tensor plan with tp > 1, the cp routing with cp > 1, recomputation
    and compile when asked, the dp wrap always (with one dp rank it is a no-op broadcast and, for ``ddp``, a one-rank
    DDP)."""
    wanted = {
        "pipeline split": pipeline if pipeline is not None else dims.pp > 1,
        "placement": True,
        "tensor plan": dims.tp > 1,
        "context parallel": dims.cp > 1,
        "activation checkpointing": layout.activation_checkpointing != "none",
        "compile": bool(layout.compile),
        "data-parallel wrap": True,
    }
    return tuple(step for step in COMPOSITION_ORDER if wanted[step])
