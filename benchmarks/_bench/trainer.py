"""The library's strategies and Lightning's built-ins under the Lightning Trainer, clocked by a callback."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import Tensor
from torch.utils.data import DataLoader

from .anchors import _fsdp, _host_adam, apply_tp
from .cases import lightning_name
from .counting import book_exchanges, python_allreduce_hook
from .timing import Ctx, Timer


def _probe(ctx: Ctx) -> Any:
    import lightning.pytorch as pl

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.timer = Timer(ctx)

        def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
            if ctx.counter is not None and ctx.case.key == "dp":  # lp_dp counts its exchanges only when asked
                trainer.strategy.count_communication()

        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            from torch.nn.parallel import DistributedDataParallel

            if ctx.counter is not None and isinstance(trainer.strategy.model, DistributedDataParallel):
                python_allreduce_hook(trainer.strategy.model)

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx % ctx.accumulate:  # an optimizer step is timed from its first batch to its last
                return
            batch_idx //= ctx.accumulate
            exchanges = self._exchanges(trainer, batch_idx)
            if exchanges is not None:
                exchanges.reset()
            self.timer.begin(batch_idx)

        def _exchanges(self, trainer: pl.Trainer, batch_idx: int) -> Any:
            """lp_dp's exchange counter on the counted step (one process: no collective for ``CommCount``)."""
            if ctx.counter is None or ctx.case.key != "dp" or batch_idx != ctx.total_steps - 1:
                return None
            return getattr(trainer.strategy, "exchange_counter", None)

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if (batch_idx + 1) % ctx.accumulate:
                return
            batch_idx //= ctx.accumulate
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            if ctx.case.cp > 1:  # the loss of this rank's tokens; the logged one is averaged over dp x cp
                loss = trainer.callback_metrics["train_loss"]
            if hasattr(loss, "full_tensor"):
                loss = loss.full_tensor()
            self.timer.end(batch_idx, None if loss is None else loss.detach().item())
            exchanges = self._exchanges(trainer, batch_idx)
            if exchanges is not None:
                assert ctx.counter is not None
                book_exchanges(ctx.counter, exchanges)
            if batch_idx == ctx.total_steps - 1:
                from lightning_parallel.callbacks.model_states import measure_rank_states

                ctx.out["states"] = measure_rank_states(trainer, pl_module)

    return Probe()


def _data_module(ctx: Ctx) -> Any:
    import lightning.pytorch as pl

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return ctx.loader()

    return Data()


def _model_parallel_gpt(ctx: Ctx) -> Any:
    """The GPT for Lightning's ModelParallelStrategy: ``configure_model`` applies the hand-written plan (TP over
    ``tensor_parallel``, FSDP2 over ``data_parallel``), the loss and its backward run under ``loss_parallel``; the
    training step logs ``train_loss`` as the GPT's does (this rank's value, Lightning's default)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_parallel.models import GPT

    tp = ctx.case.tp

    class ModelParallelGPT(GPT):
        def configure_model(self) -> None:
            mesh = self.device_mesh
            if tp > 1:
                apply_tp(self, mesh["tensor_parallel"])
            if mesh["data_parallel"].size() > 1:
                _fsdp(self, mesh=mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            with loss_parallel() if tp > 1 else contextlib.nullcontext():
                loss = self._loss(batch)
            # logs what the GPT's own training step logs (each Lightning log call costs ~0.1-1 ms of its Python on
            # a CPU; without it this variant did less work per step than the library's run of the same GPT)
            self.log("train_loss", loss.full_tensor() if isinstance(loss, DTensor) else loss, prog_bar=True)
            return loss

        def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
            with loss_parallel() if tp > 1 else contextlib.nullcontext():
                loss.backward()

    return ctx.model(ModelParallelGPT)


def _host_adam_gpt(ctx: Ctx) -> Any:
    """The GPT with DeepSpeed's CPU Adam as its optimizer, as Lightning's ``deepspeed`` offload needs (DeepSpeed
    refuses a torch optimizer under ZeRO-Offload); the library's ``lp_zero_offload`` makes that swap itself."""
    from lightning_parallel.models import GPT

    class HostAdamGPT(GPT):
        def configure_optimizers(self) -> Any:
            return _host_adam(self)

    return ctx.model(HostAdamGPT)


def _our_strategy(ctx: Ctx) -> Any:
    from lightning_parallel.strategies import (
        LPDDPStrategy,
        LPDPStrategy,
        LPHybridStrategy,
        LPPipelineStrategy,
        LPShardedStrategy,
        LPTensorStrategy,
        LPZeroOffloadStrategy,
    )

    c, m = ctx.case, ctx.a.micro_batches
    on = {"compile": bool(getattr(ctx.a, "compile", False))}  # --compile: parallel.compile (each block, inductor)
    if c.key == "dp":
        return LPDPStrategy()
    if c.key == "ddp":
        return LPDDPStrategy(on)
    if c.key in ("zero1", "zero2", "zero3"):
        return LPShardedStrategy(on, zero_stage=c.zero)
    if c.key == "cp":
        return LPDDPStrategy({**on, "context_parallel_size": c.cp})
    if c.key == "hsdp":
        return LPShardedStrategy({**on, "zero_stage": c.zero, "data_parallel_shard_size": c.shard})
    if c.key == "ppzero3":
        return LPPipelineStrategy({**on, "data_parallel_size": c.dp, "pipeline_parallel_size": c.pp,
                                   "zero_stage": c.zero, "num_micro_batches": m, "pipeline_schedule": "1f1b"})
    if c.key == "offload":
        return LPZeroOffloadStrategy(on, zero_stage=c.zero, offload=c.offload)  # type: ignore[arg-type]
    if c.key in ("tp", "tp2d"):
        return LPTensorStrategy({**on, "data_parallel_size": c.dp, "tensor_parallel_size": c.tp, "zero_stage": c.zero})
    if c.key == "pp":
        return LPPipelineStrategy({**on, "pipeline_parallel_size": c.pp, "num_micro_batches": m,
                                   "pipeline_schedule": "1f1b"})
    return LPHybridStrategy({**on, "data_parallel_size": c.dp, "pipeline_parallel_size": c.pp,
                             "tensor_parallel_size": c.tp, "zero_stage": 0, "num_micro_batches": m,
                             "pipeline_schedule": "1f1b"})


def _lightning_strategy(ctx: Ctx) -> Any:
    from lightning.pytorch import strategies as ls

    name = lightning_name(ctx.case, ctx.device.type)
    if name == "ddp":
        return ls.DDPStrategy()
    if name == "model_parallel":
        return ls.ModelParallelStrategy(data_parallel_size=ctx.case.dp, tensor_parallel_size=ctx.case.tp)
    if name is not None and name.startswith("deepspeed"):
        stage = int(name.split("_")[2])
        return ls.DeepSpeedStrategy(stage=stage, offload_optimizer=name.endswith("offload"))
    raise ValueError(f"case {ctx.case.key}: no Lightning built-in on {ctx.device.type}")


def run_trainer(ctx: Ctx) -> dict[str, Any]:
    import lightning.pytorch as pl

    lightning = ctx.role == "lightning"
    strategy = _lightning_strategy(ctx) if lightning else _our_strategy(ctx)
    name = lightning_name(ctx.case, ctx.device.type) if lightning else None
    if name == "model_parallel":
        model = _model_parallel_gpt(ctx)
    elif name is not None and name.endswith("offload"):
        model = _host_adam_gpt(ctx)
    else:
        model = ctx.model()
    probe = _probe(ctx)
    devices = ctx.case.dp if ctx.case.key == "dp" else ctx.world
    trainer = pl.Trainer(accelerator=ctx.device.type, devices=devices, strategy=strategy,
                         max_steps=ctx.total_steps, accumulate_grad_batches=ctx.accumulate, logger=False,
                         enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[probe])
    trainer.fit(model, datamodule=_data_module(ctx))
    return {**probe.timer.result(), **ctx.out}


