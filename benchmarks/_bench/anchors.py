"""The hand-written torch loops: each technique with torch alone, no framework, on the same GPT, batches and seed."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.parallel.counters import uncounted_all_reduce

from .counting import python_allreduce_hook
from .timing import Ctx, Timer


def _device_batch(ctx: Ctx, batch: Any) -> tuple[Tensor, Tensor]:
    x, y = batch
    return x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)


def _hand_loop(ctx: Ctx, step: Callable[[Tensor, Tensor], Any]) -> dict[str, Any]:
    timer = Timer(ctx)
    batches = iter(ctx.loader())
    for i in range(ctx.total_steps):
        x, y = _device_batch(ctx, next(batches))
        timer.begin(i)
        loss = step(x, y)
        timer.end(i, loss)
    return timer.result()


def _states(model: Any = None, optimizer: Any = None, *, engine: Any = None) -> dict[str, int]:
    from lightning_parallel.callbacks.model_states import model_state_bytes

    return model_state_bytes(model, optimizer, engine=engine)


def _plain_step(model: Any, net: Any, opt: Any) -> Callable[[Tensor, Tensor], float]:
    """One training step of ``net`` (the model or its wrapper): zero the gradients first, as Lightning does, so the
    last step's gradients are still there to be measured."""

    def step(x: Tensor, y: Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = model.pipeline_loss(net(x), y)
        loss.backward()
        opt.step()
        return float(loss.item())

    return step


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    """The GPT's own optimizer (AdamW, decayed and non-decayed groups), built from the parameters as they are now."""
    return model.configure_optimizers()["optimizer"]  # type: ignore[operator,no-any-return]



def hand_one(ctx: Ctx) -> dict[str, Any]:
    model = ctx.model().to(ctx.device)
    if ctx.device.type == "cuda" and ctx.case.dp > 1:
        net: Any = nn.DataParallel(model, device_ids=list(range(ctx.case.dp)))
    else:
        net = model
    opt = _adamw(model)
    out = _hand_loop(ctx, _plain_step(model, net, opt))
    out["states"] = _states(model, opt)
    return out


def hand_ddp(ctx: Ctx, zero: bool = False) -> dict[str, Any]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = ctx.model().to(ctx.device)
    ddp = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    if ctx.counter is not None:
        python_allreduce_hook(ddp)
    if zero:
        groups = _adamw(model).param_groups
        opt: Any = ZeroRedundancyOptimizer(
            [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
            optimizer_class=torch.optim.AdamW, lr=groups[0]["lr"], betas=groups[0]["betas"])
    else:
        opt = _adamw(model)
    out = _hand_loop(ctx, _plain_step(model, ddp, opt))
    if zero:  # ZeroRedundancyOptimizer's local optimizer holds this rank's share of the states
        out["states"] = _states(model, opt.optim)
    else:
        out["states"] = _states(model, opt)
    return out


def _fsdp(model: Any, mesh: Any = None, reshard: bool = True) -> None:
    """FSDP2 on the units the library shards (``parallel.zero.stage3``; torchtitan's too): every block, the
    embedding, the head, then the root, the head kept gathered from its forward into its backward (which begins
    with it) -- the same technique, so that a difference is the framework's."""
    from torch.distributed.fsdp import fully_shard

    for unit in [*model.blocks.values(), model.embed]:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model.head, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def hand_fsdp(ctx: Ctx, reshard: bool = True) -> dict[str, Any]:
    model = ctx.model().to(ctx.device)
    mesh = None
    if ctx.case.shard:  # HSDP: shard inside groups of `shard`, replicate across
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(ctx.device.type, (ctx.case.dp // ctx.case.shard, ctx.case.shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    _fsdp(model, mesh=mesh, reshard=reshard)
    opt = _adamw(model)
    out = _hand_loop(ctx, _plain_step(model, model, opt))
    out["states"] = _states(model, opt)
    return out


def _offload_config(ctx: Ctx) -> dict[str, Any]:
    from lightning_parallel.parallel.offload.config import OffloadEngineConfig

    cfg = OffloadEngineConfig.from_dict({"zero_optimization": {
        "stage": ctx.case.zero, "offload_optimizer": {"device": ctx.case.offload}}}).to_deepspeed()
    cfg.update(train_micro_batch_size_per_gpu=ctx.a.batch // ctx.case.dp, gradient_accumulation_steps=1,
               gradient_clipping=0.0)
    return cfg


def _host_adam(model: Any) -> Any:
    """DeepSpeed's CPU Adam (AdamW mode) over the GPT's own parameter groups and hyper-parameters."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    groups = _adamw(model).param_groups
    return DeepSpeedCPUAdam([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
                            lr=groups[0]["lr"], betas=groups[0]["betas"], adamw_mode=True)


def hand_deepspeed(ctx: Ctx) -> dict[str, Any]:
    import deepspeed

    model = ctx.model()
    opt = _host_adam(model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_offload_config(ctx),
                                      dist_init_required=False)

    def step(x: Tensor, y: Tensor) -> float:
        loss = model.pipeline_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    out = _hand_loop(ctx, step)
    out["states"] = _states(engine=engine)
    engine.destroy()
    return out


def tp_plan(model: Any) -> dict[str, Any]:
    """Megatron's split with torch's stock styles: q/k/v and fc_in column, out_proj and fc_out row, the token
    embedding vocab-parallel (row-wise lookup, all-reduce), lm_head column-parallel with vocab-sharded logits (the loss
    under ``loss_parallel``); attention and MLP inputs declared replicated DTensors so that their consumers' input
    gradients are summed first and all-reduced once per block input (Megatron's ``f``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    plan: dict[str, Any] = {}
    if getattr(model, "embed", None) is not None:
        plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for i in model.blocks:
        for sub in ("attn", "mlp"):
            plan[f"blocks.{i}.{sub}"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                           desired_input_layouts=(Replicate(),))
        for lin in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"):
            plan[f"blocks.{i}.{lin}"] = ColwiseParallel()
        for lin in ("attn.out_proj", "mlp.fc_out"):
            plan[f"blocks.{i}.{lin}"] = RowwiseParallel()
    if getattr(model, "head", None) is not None:
        plan["head.lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def apply_tp(model: Any, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, tp_plan(model))


def _mesh(ctx: Ctx) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, ctx.dims.shape, mesh_dim_names=ctx.dims.order)


def hand_tp(ctx: Ctx) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = _mesh(ctx)
    model = ctx.model().to(ctx.device)
    apply_tp(model, mesh["tp"])
    if ctx.case.dp > 1:
        _fsdp(model, mesh=mesh["dp"])
    opt = _adamw(model)

    def step(x: Tensor, y: Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = model.pipeline_loss(model(x), y)
            loss.backward()
        opt.step()
        return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()

    out = _hand_loop(ctx, step)
    out["states"] = _states(model, opt)
    return out


def _stage_module(ctx: Ctx, model: Any) -> Any:
    """Keep this pipeline rank's layers of ``[embed, block 0..L-1, head]`` (balanced by layer count)."""
    from lightning_parallel.parallel.pipeline import stage_ranges

    layers = ["embed", *[f"blocks.{i}" for i in model.blocks], "head"]
    start, stop = stage_ranges(len(layers), ctx.case.pp)[ctx.coords.pp]
    keep = set(layers[start:stop])
    if "embed" not in keep:
        model.embed = None
    if "head" not in keep:
        model.head = None
    for i in list(model.blocks):
        if f"blocks.{i}" not in keep:
            del model.blocks[i]
    return model


def hand_pipeline(ctx: Ctx) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = _mesh(ctx)
    model = _stage_module(ctx, ctx.model()).to(ctx.device)
    tp = ctx.case.tp > 1
    if tp:
        apply_tp(model, mesh["tp"])
    fsdp = ctx.case.zero >= 2
    if fsdp:  # FSDP2 on the stage over dp; the last stage keeps its parameters from forward to backward (1F1B)
        from torch.distributed.fsdp import fully_shard

        reshard = ctx.case.zero == 3 and ctx.coords.pp < ctx.case.pp - 1
        for unit in [*model.blocks.values(), model.embed, model.head]:
            if unit is not None:
                fully_shard(unit, mesh=mesh["dp"], reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard)
    stage = PipelineStage(model, ctx.coords.pp, ctx.case.pp, ctx.device, group=mesh["pp"].get_group())
    first, last = ctx.coords.pp == 0, ctx.coords.pp == ctx.case.pp - 1

    def loss_fn(out: Any, target: Tensor) -> Tensor:
        return model.pipeline_loss(out, target)  # type: ignore[no-any-return]

    schedule = Schedule1F1B(stage, ctx.a.micro_batches, loss_fn=loss_fn)
    opt = _adamw(model)
    dp_group = mesh["dp"].get_group() if ctx.case.dp > 1 and not fsdp else None  # FSDP2 reduces on its own

    def step(x: Tensor, y: Tensor) -> float | None:
        opt.zero_grad(set_to_none=True)
        losses: list[Tensor] = []
        with loss_parallel() if tp else contextlib.nullcontext():
            if first:
                schedule.step(x, target=y if last else None, losses=losses if last else None)
            elif last:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
        if dp_group is not None:  # data parallel over dp: the mean of the local gradient shards
            for p in model.parameters():
                if p.grad is not None:
                    local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    dist.all_reduce(local, group=dp_group)
                    local.div_(ctx.case.dp)
        opt.step()
        if not last:
            return None
        values = [(t.full_tensor() if hasattr(t, "full_tensor") else t).item() for t in losses]
        return sum(values) / len(values)

    out = _hand_loop(ctx, step)
    out["states"] = _states(model, opt)
    return out


def _cp_cpu(ctx: Ctx, model: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    """CPU's forward + backward: torch's ``context_parallel`` dispatches CUDA attention kernels only, so the hand loop
    runs the library's ring-attention units without the library's strategy or Lightning -- the GPT's attention routed
    to the ring over the cp ranks (``apply_context_parallel``), each rank's head and tail chunks of ``x`` and ``y`` cut
    by hand, torch DDP over cp: the same technique and kernels as the library's run, so a difference is the
    framework's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from lightning_parallel.parallel.context_parallel import SequenceShard, apply_context_parallel, shard_sequence

    mesh = init_device_mesh("cpu", (ctx.case.cp,), mesh_dim_names=("cp",))
    shard = SequenceShard(ctx.case.cp, dist.get_rank())
    apply_context_parallel(model, group=mesh.get_group(), shard=shard, style="ring")
    ddp = DistributedDataParallel(model)
    if ctx.counter is not None:
        python_allreduce_hook(ddp)

    def forward_backward(x: Tensor, y: Tensor) -> Tensor:
        loss: Tensor = model.pipeline_loss(ddp(shard_sequence(x, 1, shard)), shard_sequence(y, 1, shard))  # type: ignore[operator]
        loss.backward()
        return loss

    return forward_backward


def _cp_cuda(ctx: Ctx, model: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    """CUDA's forward + backward: torch's own API -- DDP over the cp ranks and ``context_parallel(mesh, buffers=[x,
    y])`` around forward and backward (head-tail load balancing, its ring); the GPT's positions come from this rank's
    head-tail chunks, the layout torch's balancer gives them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.parallel import DistributedDataParallel

    from lightning_parallel.parallel.context_parallel import ContextParallelState, SequenceShard, activated

    cp = ctx.case.cp
    mesh = init_device_mesh("cuda", (cp,), mesh_dim_names=("cp",))
    ddp = DistributedDataParallel(model, device_ids=[ctx.device.index])
    state = ContextParallelState(group=mesh.get_group(), shard=SequenceShard(cp, dist.get_rank()), style="ring")

    def forward_backward(x: Tensor, y: Tensor) -> Tensor:
        with activated(state), context_parallel(mesh, buffers=[x, y], buffer_seq_dims=[1, 1],
                                                no_restore_buffers={x, y}):
            loss: Tensor = model.pipeline_loss(ddp(x), y)  # type: ignore[operator]
            loss.backward()
        return loss

    return forward_backward


def hand_cp(ctx: Ctx) -> dict[str, Any]:
    """Context parallelism's anchors: CPU, a hand loop over the library's ring-attention units (:func:`_cp_cpu`; there
    is no torch CP to run on CPU); CUDA, torch's ``context_parallel`` (:func:`_cp_cuda`). AdamW; the loss averaged
    over cp (one all-reduce, the one-device value)."""
    model = ctx.model().to(ctx.device)
    opt = _adamw(model)
    forward_backward = (_cp_cuda if ctx.device.type == "cuda" else _cp_cpu)(ctx, model)

    def step(x: Tensor, y: Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(x, y)
        opt.step()
        mean = loss.detach().clone()
        uncounted_all_reduce(mean)  # the logged loss: control traffic, as the library books it
        return float(mean.item()) / ctx.case.cp

    out = _hand_loop(ctx, step)
    out["states"] = _states(model, opt)
    return out


HAND: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "dp": hand_one, "ddp": hand_ddp, "zero1": functools.partial(hand_ddp, zero=True),
    "zero2": functools.partial(hand_fsdp, reshard=False), "zero3": hand_fsdp, "offload": hand_deepspeed,
    "tp": hand_tp, "tp2d": hand_tp, "pp": hand_pipeline, "hybrid": hand_pipeline,
    "ppzero3": hand_pipeline, "hsdp": hand_fsdp, "cp": hand_cp,
}


