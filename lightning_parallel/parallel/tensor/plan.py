"""Tensor-parallel plans: a module's ``tensor_parallel_plan()`` applied with ``torch.distributed.tensor`` over ``tp``.

A plan maps submodule names (or glob patterns, ``*`` = one dotted component: ``"blocks.*.attn.q_proj"``) to a style.
With ``t`` ranks on the 1-D ``tp`` mesh (Megatron-LM's layout; Shoeybi et al. 2019, Korthikanti et al. 2022 for
sequence parallelism):

* ``column`` -- ``nn.Linear`` split by output features (``ColwiseParallel``: weight rows and bias over ``tp``; the
  output is local, ``features/t`` wide). Forward: none. Backward: all-reduce of the input gradient (once per input:
  the consumers of one ``sequence`` norm share it). SP: the input is all-gathered along the sequence in forward and
  its gradient reduce-scattered in backward.
* ``row`` -- ``nn.Linear`` split by input features (``RowwiseParallel``: weight columns; bias replicated).
  Forward: all-reduce of the partial outputs (SP: reduce-scatter along the sequence). Backward: none (SP: all-gather).
* ``vocab`` -- ``nn.Embedding`` split by rows of the vocabulary (``RowwiseParallel``; forward all-reduce of the
  partial lookups, SP: reduce-scatter), or an output ``nn.Linear`` split by vocabulary columns whose logits stay a
  ``Shard(-1)`` DTensor: the loss must run under ``torch.distributed.tensor.parallel.loss_parallel`` (a
  vocab-parallel cross-entropy: all-reduces of ``b x s`` max/sum statistics). Backward as ``column``.
* ``sequence`` -- a norm whose output feeds ``column``/``vocab`` linears; parameters replicated. SP: it runs on its
  ``s/t`` positions (``SequenceParallel``), its output is all-gathered (forward) / its gradient reduce-scattered
  (backward), and its weights' partial gradients are all-reduced at the step boundary. Without SP: one all-reduce
  of its output gradient in backward (Megatron's ``f``).
* ``sequence_scatter`` -- a module whose replicated output starts the sequence-sharded region (token + learned
  position embeddings, added inside it). SP: a local slice in forward (no traffic), an all-gather of the gradient in
  backward; a ``vocab`` embedding inside it then all-reduces. Without SP: nothing.
* ``replicate`` -- nothing: the parameters stay whole on every tp rank (stated explicitly, validated like the rest).

A value may also be a torch ``ParallelStyle`` object (full control). A key that matches no submodule is an error
naming it, unless ``skip_missing`` (a pipeline stage that lacks those layers). Under ``sequence_parallel`` the
residual stream between blocks is a local tensor holding this rank's ``t/tp`` positions; every module with
parameters that runs on it must be in the plan (norms as ``sequence``), else its gradients would be partial.
No Lightning import.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_parallel.module_hooks import TP_STYLES

__all__ = ["PLAN_STYLES", "PlanError", "apply_tensor_parallel", "expand_plan", "make_style"]

PLAN_STYLES = TP_STYLES
"""The string values a plan may use (or a ``ParallelStyle`` object): the module hook's list."""

_SEQ = 1  # the sequence dimension of (batch, sequence, features) activations


class PlanError(ValueError):
    """A tensor-parallel plan that does not fit its module (unknown name, style or module type)."""


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("^" + r"[^.]+".join(re.escape(part) for part in key.split("*")) + "$")


def expand_plan(module: nn.Module, plan: Mapping[str, Any], *, skip_missing: bool = False) -> dict[str, Any]:
    """Plan keys (names or ``*`` patterns) -> ``{submodule name: style}`` in module order; checks names and styles.

    Raises :class:`PlanError` for a key that matches nothing (unless ``skip_missing``), a name matched by two keys,
    or a value that is neither one of :data:`PLAN_STYLES` nor a ``ParallelStyle``.
    """
    names = [n for n, _ in module.named_modules() if n]
    out: dict[str, Any] = {}
    source: dict[str, str] = {}
    for key, style in plan.items():
        if not (isinstance(style, ParallelStyle) or style in PLAN_STYLES):
            raise PlanError(
                f"tensor_parallel_plan()[{key!r}] = {style!r} is not a style. Fix: one of {list(PLAN_STYLES)} or a "
                "torch.distributed.tensor.parallel.ParallelStyle object."
            )
        matched = [n for n in names if _pattern(key).match(n)] if "*" in key else [key] if key in names else []
        if not matched:
            if skip_missing:
                continue
            close = [n for n in names if n.split(".")[-1] == key.split(".")[-1]][:3]
            hint = f" Submodules with that last name: {close}." if close else ""
            raise PlanError(
                f"tensor_parallel_plan() key {key!r} matches no submodule of {type(module).__name__}.{hint} Fix: use "
                "names from module.named_modules() ('*' matches one dotted component, e.g. 'blocks.*.attn.q_proj')."
            )
        for name in matched:
            if name in out:
                raise PlanError(f"tensor_parallel_plan(): {name!r} is matched by both {source[name]!r} and {key!r}. "
                                "Fix: give each submodule one style.")
            out[name], source[name] = style, key
    order = {n: i for i, n in enumerate(names)}
    return dict(sorted(out.items(), key=lambda item: order[item[0]]))


class _HandToTP(torch.autograd.Function):
    """A norm's plain local output -> one replicated DTensor for the tensor-parallel linears that read it.

    Forward: with SP, all-gather of the sequence shards (dim 1); without, nothing. Backward: the consumers' input
    gradients arrive summed as one ``Partial`` DTensor; its local partial sum is reduce-scattered along the sequence
    (SP) or all-reduced (Megatron's ``f``): one collective per norm, whatever the number of consumers. (Left to
    DTensor, the same gradient was all-reduced once more per consumer group under SP, measured.)
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, mesh: DeviceMesh, sequence_parallel: bool) -> DTensor:
        ctx.mesh, ctx.sp = mesh, sequence_parallel
        if sequence_parallel:
            x = funcol.all_gather_single(x.contiguous(), gather_dim=_SEQ, group=mesh)
            x = funcol.wait_tensor(x) if isinstance(x, funcol.AsyncCollectiveTensor) else x
        return DTensor.from_local(x, mesh, (Replicate(),), run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Tensor, None, None]:
        mesh, sp = ctx.mesh, ctx.sp
        partial = isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements)
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        if partial:
            if sp:
                out = funcol.reduce_scatter_single(local.contiguous(), "sum", scatter_dim=_SEQ, group=mesh)
            else:
                out = funcol.all_reduce(local, "sum", group=mesh)
            out = funcol.wait_tensor(out)
        elif sp:  # already whole: this rank's positions
            out = local.chunk(mesh.size(), dim=_SEQ)[mesh.get_local_rank()].contiguous()
        else:
            out = local
        return out, None, None


class _SequenceNorm(ParallelStyle):
    """``sequence``: a norm whose output feeds tensor-parallel linears, handed on as a replicated DTensor.

    Under SP the norm runs on its sequence shard (``SequenceParallel``: replicated DTensor parameters, whose
    gradients are ``Partial`` sums over the shards until :func:`~lightning_parallel.parallel.tensor.sync.
    settle_gradients`); then :class:`_HandToTP` gathers the shards (one all-gather forward, one reduce-scatter
    backward). Without SP the norm is left alone and :class:`_HandToTP` adds the one all-reduce in backward.
    """

    def __init__(self, *, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sp = self.sequence_parallel
        if sp:
            SequenceParallel(sequence_dim=_SEQ, use_local_output=True)._apply(module, device_mesh)

        # Run eagerly inside a compiled block (parallel.compile): traced by torch.compile (torch 2.13), the backward
        # of _HandToTP lost its all-reduce of the Partial gradient and training drifted (1.6e-2 off one device after
        # 10 steps, measured); eager, it is exact. A graph break at each such norm.
        @torch.compiler.disable
        def hand(mod: nn.Module, inputs: Any, output: Any) -> Any:
            if isinstance(output, DTensor):
                return output
            return _HandToTP.apply(output, device_mesh, sp)

        module.register_forward_hook(hand)
        return module


class _Colwise(ColwiseParallel):
    """``ColwiseParallel`` that takes a DTensor input as it is laid out: a replicated input from a ``sequence`` norm
    is not redistributed again (torch's redistributes whenever ``input_layouts`` differs from Replicate, and its
    backward then all-reduces the input gradient once per consumer); a plain input is read as ``input_layouts``."""

    @staticmethod
    def _prepare_input_fn(input_layouts: Any, desired_input_layouts: Any, mod: nn.Module, inputs: Any,
                          device_mesh: DeviceMesh) -> Any:
        x = inputs[0]
        if isinstance(x, DTensor):
            if tuple(x.placements) == tuple(desired_input_layouts):
                return x
            return x.redistribute(placements=desired_input_layouts)
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)


def make_style(style: Any, module: nn.Module, *, name: str, sequence_parallel: bool,
               vocab_output: str = "auto") -> ParallelStyle | None:
    """The torch ``ParallelStyle`` for one plan entry (None for ``replicate`` and for ``sequence_scatter`` without
    SP). ``vocab_output``: for a vocab-parallel embedding under SP, ``"sequence"`` reduce-scatters its output along
    the sequence, ``"replicate"`` all-reduces it (a ``sequence_scatter`` ancestor splits it later)."""
    if isinstance(style, ParallelStyle):
        return style
    seq_in: Any = Shard(_SEQ) if sequence_parallel else Replicate()
    kind = type(module).__name__

    def need(*types: type) -> None:
        if not isinstance(module, types):
            raise PlanError(
                f"tensor_parallel_plan()[{name!r}] = {style!r} needs {' or '.join(t.__name__ for t in types)}, but "
                f"{name} is a {kind}. Fix: name the linear/embedding itself (e.g. '{name}.<child>'), or give a "
                "ParallelStyle object."
            )

    if style == "column":
        need(nn.Linear)
        return _Colwise(input_layouts=seq_in)
    if style == "row":
        need(nn.Linear)
        return RowwiseParallel(output_layouts=seq_in)
    if style == "vocab":
        need(nn.Embedding, nn.Linear)
        if isinstance(module, nn.Embedding):
            out: Any = Shard(_SEQ) if sequence_parallel and vocab_output != "replicate" else Replicate()
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=out)
        return _Colwise(input_layouts=seq_in, output_layouts=Shard(-1), use_local_output=False)
    if style == "sequence":
        return _SequenceNorm(sequence_parallel=sequence_parallel)
    if style == "sequence_scatter":
        if not sequence_parallel:
            return None
        return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(_SEQ),
                                   use_local_output=True)
    return None  # replicate


def apply_tensor_parallel(
    module: nn.Module, plan: Mapping[str, Any], *, mesh: DeviceMesh, sequence_parallel: bool = False,
    skip_missing: bool = False,
) -> dict[str, Any]:
    """Split ``module`` in place over the 1-D ``tp`` mesh as ``plan`` says; returns the expanded plan.

    Parameters of ``column``/``row``/``vocab`` modules become DTensors (``Shard`` over ``tp``; ``1/t`` of each matrix
    per rank, ``distribute_tensor`` scatters tp rank 0's values); ``sequence`` norms under SP hold ``Replicate``
    DTensors; everything else stays a plain tensor, replicated. Call once, after the module is on its device and
    before any data-parallel wrapping (FSDP2 composes on top over ``dp``).
    """
    if mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs the 1-D tp sub-mesh, got a {mesh.ndim}-D mesh.")
    expanded = expand_plan(module, plan, skip_missing=skip_missing)
    scatters = [n for n, s in expanded.items() if s == "sequence_scatter"]
    styles: dict[str, ParallelStyle] = {}
    for name, style in expanded.items():
        sub = module.get_submodule(name)
        inside_scatter = any(name.startswith(s + ".") for s in scatters)
        made = make_style(style, sub, name=name, sequence_parallel=sequence_parallel,
                          vocab_output="replicate" if inside_scatter else "sequence")
        if made is not None:
            styles[name] = made
    if sequence_parallel:  # where the sequence is split: an uneven split would fail later inside a collective
        for name, style in expanded.items():
            sub = module.get_submodule(name)
            if style == "sequence_scatter" or (style == "vocab" and isinstance(sub, nn.Embedding)
                                               and not any(name.startswith(s + ".") for s in scatters)):
                sub.register_forward_pre_hook(_check_sequence(name, mesh.size()))
    # children before parents: a parent's output hook (sequence_scatter) then runs after its children's
    for name in sorted(styles, key=lambda n: -n.count(".")):
        parallelize_module(module.get_submodule(name), mesh, styles[name])
    return expanded


def _check_sequence(name: str, tp: int) -> Any:
    def check(mod: nn.Module, inputs: tuple[Any, ...]) -> None:
        x = inputs[0] if inputs else None
        if isinstance(x, Tensor) and x.dim() >= 2 and x.shape[_SEQ] % tp:
            n = x.shape[_SEQ]
            raise ValueError(
                f"sequence_parallel splits the sequence over tensor_parallel_size={tp} ranks, but {name} got a "
                f"sequence of {n} positions: {n} % {tp} = {n % tp}. Fix: a sequence length that is a multiple of "
                f"{tp} (e.g. {n - n % tp} or {n + tp - n % tp}), or sequence_parallel=False."
            )

    return check
