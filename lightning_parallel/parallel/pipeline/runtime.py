"""``PipelineRunner``: run one rank's stages under a torch pipeline schedule, for training and for forward-only
evaluation, and hand the last stage's results to every pipeline rank.

Collectives per training step of ``m`` micro-batches (``b`` samples each, activations ``b x s x h`` between
stages): forward sends each micro-batch's activation from stage ``k`` to ``k + 1`` (point-to-point over the ``pp``
group), backward sends its gradient back; ``2 (n - 1) m`` messages per step for ``n = p x v`` stages (one per
tensor crossing the boundary when the layers carry several, :meth:`StagePlan.boundaries
<lightning_parallel.parallel.pipeline.stage.StagePlan.boundaries>`; tensors that need no gradient, such as a mask,
get no message back). Then one
broadcast of the step's mean loss from the last stage's rank over ``pp``. Nothing is all-reduced here: the dp-axis
gradient sync is the strategy's.

Gradients: each micro-batch's loss is divided by ``m x accumulate`` before its backward (the schedule's own
``scale_grads`` is off: it would also divide gradients accumulated over earlier batches), so after a step's
schedule every stage's ``.grad`` holds the gradient of the batch's mean loss, exactly as one device's backward of
the whole batch does, and gradient accumulation over batches adds up like Lightning's.

Evaluation runs forward only (``torch.no_grad``) under GPipe (one stage per rank) or looped BFS (several) with as
many micro-batches as divide the batch (at most ``num_micro_batches``); the last stage's output -- the whole batch's,
concatenated along dim 0 -- is where the loss is computed. torch's schedules end every step with each stage's
gradient reduction (FSDP2's post-backward: a reduce-scatter of the gradients; the division by the micro-batches when
``scale_grads``) even when only forwards ran, and a schedule's first step clears the gradients of its FSDP2 chunks
after its shape inference: an evaluation step skips the one and puts the gradients back after the other (so does a
new training schedule's first step, adding its own), so that a validation run -- or a batch of a new shape -- in the
middle of a step's gradient accumulation leaves the gradients accumulated so far as they were.
Stages may be tensor-parallel (DTensor parameters, a vocab-parallel head whose loss runs under ``loss_parallel``):
losses and outputs handed on are made plain first (:func:`~lightning_parallel.parallel.tensor.local.plain`). No
Lightning import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.config import SCHEDULES

from ..tensor.local import plain
from .stage import StagePlan, input_names

__all__ = ["PipelineRunner", "largest_divisor_at_most"]


def _no_reduction(grad_scale_factor: int) -> None:
    """A stage's ``perform_reduce_grad`` during a forward-only step: nothing to reduce."""


def _inference_leaves_no_trace(stage: Any) -> Any:
    """``stage`` with torch's shape inference made side-effect free. A schedule's first step (and the first after a
    switch between training and evaluation) infers each stage's input and output shapes by running the stage once
    before the real micro-batches -- forward, then (training) backward: the first stage on its real micro-batch,
    the others on scratch tensors made with ``torch.empty``. That extra forward updated the module's buffers -- a
    BatchNorm's running statistics from uninitialised memory (``inf``, 1e32), one more ``num_batches_tracked``, a
    user's counter -- and under ``detect_anomaly`` the backward on such memory raised "returned nan values". Here
    the scratch tensors are zeros, and every buffer of the stage is put back (the same tensor object, its values
    restored) once the inference is over: after its backward where one follows (autograd may have saved a buffer
    for it: a BatchNorm's running statistics), else after its forward. Nothing is patched on a torch without these
    methods."""
    infer = getattr(stage, "_forward_metadata_inference", None)
    infer_backward = getattr(stage, "_backward_metadata_inference", None)
    to_tensor = getattr(stage, "_to_tensor", None)
    pending: list[list[tuple[nn.Module, str, Tensor, Tensor]]] = []

    def restore() -> None:
        with torch.no_grad():
            while pending:
                for module, name, buffer, value in pending.pop():
                    module._buffers[name] = buffer  # a buffer the forward replaced by another tensor
                    buffer.copy_(value)

    if callable(infer) and callable(infer_backward):
        def forward_inference(*args: Any, **kwargs: Any) -> Any:
            restore()  # an inference whose backward never ran
            pending.append([(module, name, buffer, buffer.detach().clone()) for module in stage.submod.modules()
                            for name, buffer in module._buffers.items() if buffer is not None])
            try:
                out = infer(*args, **kwargs)
            except BaseException:
                restore()
                raise
            if not kwargs.get("has_backward", args[2] if len(args) > 2 else False):
                restore()
            return out

        def backward_inference(*args: Any, **kwargs: Any) -> Any:
            try:
                return infer_backward(*args, **kwargs)
            finally:
                restore()

        stage._forward_metadata_inference = forward_inference
        stage._backward_metadata_inference = backward_inference
    if callable(to_tensor):
        def zeros(arg: Any) -> Any:
            out = to_tensor(arg)
            if not isinstance(arg, Tensor):  # made from metadata: uninitialised memory
                with torch.no_grad():
                    (out.to_local() if hasattr(out, "to_local") else out).zero_()
            return out

        stage._to_tensor = zeros
    return stage


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest ``d <= limit`` that divides ``n`` (at least 1)."""
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    return 1


class PipelineRunner:
    """This rank's stages and the schedules that run them.

    Args:
        chunks: ``(stage_index, module)`` of each stage this rank runs, in order.
        num_stages: ``n = p x v``, stages of the whole pipeline.
        schedule: a key of :data:`~lightning_parallel.config.SCHEDULES`.
        num_micro_batches: ``m`` micro-batches per training step.
        group: the ``pp`` process group; ``group_ranks``: its global ranks in pipeline order.
        device: where the stages live.
        loss_fn: ``loss_fn(output, target)`` -> mean loss of one micro-batch (the module's ``pipeline_loss``).
        plan: the cut (:class:`~lightning_parallel.parallel.pipeline.stage.StagePlan`): which named tensors cross each
            stage boundary for a given pipeline input (default: one tensor in, one out).
    """

    def __init__(self, chunks: list[tuple[int, nn.Module]], *, num_stages: int, schedule: str,
                 num_micro_batches: int, group: dist.ProcessGroup, group_ranks: list[int], device: torch.device,
                 loss_fn: Callable[[Tensor, Tensor], Tensor], plan: StagePlan | None = None) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {schedule!r} is not one of {sorted(SCHEDULES)}.")
        self.chunks = chunks
        self.num_stages = num_stages
        self.schedule_name = schedule
        self.m = num_micro_batches
        self.group = group
        self.group_ranks = group_ranks
        self.p = len(group_ranks)
        self.device = device
        self.loss_fn = loss_fn
        self.plan = plan
        self.first = any(s == 0 for s, _ in chunks)
        self.last = any(s == num_stages - 1 for s, _ in chunks)
        self.last_rank = group_ranks[(num_stages - 1) % self.p]
        self._train: dict[Any, Any] = {}
        self._eval: dict[Any, Any] = {}
        self._losses: list[Tensor] = []
        self._scale = 1.0
        self._loss_scale: Callable[[Tensor], Tensor] | None = None

    # ------------------------------------------------------------------ schedules
    def _stages(self) -> list[Any]:
        from torch.distributed.pipelining import PipelineStage

        return [_inference_leaves_no_trace(PipelineStage(module, s, self.num_stages, self.device, group=self.group))
                for s, module in self.chunks]

    def _scaled_loss(self, output: Tensor, target: Tensor) -> Tensor:
        loss = self.loss_fn(output, target)
        self._losses.append(plain(loss.detach()))
        return loss * self._scale if self._loss_scale is None else self._loss_scale(loss * self._scale)

    def _train_schedule(self, key: Any) -> Any:
        """One schedule object per micro-batch shape (the stages infer the p2p buffer shapes on first use)."""
        if key not in self._train:
            from torch.distributed.pipelining import schedules

            info = SCHEDULES[self.schedule_name]
            cls = getattr(schedules, info.torch_class)
            stages = self._stages()
            self._train[key] = cls(stages if info.multi_stage else stages[0], self.m, loss_fn=self._scaled_loss,
                                   scale_grads=False)
        return self._train[key]

    def _eval_schedule(self, m: int, key: Any) -> tuple[Any, list[Any]]:
        if (m, key) not in self._eval:
            from torch.distributed.pipelining import schedules

            stages = self._stages()
            if len(stages) == 1:
                self._eval[(m, key)] = schedules.ScheduleGPipe(stages[0], m, scale_grads=False), stages
            else:
                self._eval[(m, key)] = schedules.ScheduleLoopedBFS(stages, m, scale_grads=False), stages
        return self._eval[(m, key)]

    def _bind(self, inputs: Any) -> tuple[tuple[str, ...], tuple[Tensor, ...]]:
        """The pipeline input's names and tensors; every chunk learns which names it receives and sends."""
        if self.plan is None:
            if not isinstance(inputs, Tensor):
                raise TypeError(f"a pipeline without a StagePlan takes one tensor, got {type(inputs).__name__}.")
            return ("hidden",), (inputs,)
        names, values = input_names(inputs, self.plan.flow(0))
        bounds = self.plan.boundaries(names)
        for s, chunk in self.chunks:
            bind = getattr(chunk, "bind", None)
            if callable(bind):
                bind(bounds[s], bounds[s + 1])
        return names, values

    @staticmethod
    def _key(names: tuple[str, ...], values: tuple[Tensor, ...], m: int) -> tuple[Any, ...]:
        return (names, tuple((tuple(v.shape), v.dtype) for v in values), m)

    # ------------------------------------------------------------------ steps
    def train_step(self, inputs: Any, target: Tensor, *, accumulate: int = 1, everywhere: bool = True,
                   loss_scale: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """Forward and backward of one batch (``.grad`` accumulates the gradient of its mean loss / ``accumulate``);
        returns the batch's mean loss (unscaled, detached) on every pipeline rank (a broadcast over ``pp``) -- or,
        with ``everywhere=False``, on the last stage's rank only (zero elsewhere, no collective: the caller combines it
        in a collective of its own). ``inputs``: a tensor, or the named tensors the first layers read (a dict, or a
        tuple in the first layer's input order). ``loss_scale``: applied to each micro-batch's loss before its
        backward (a gradient scaler's ``scale`` under ``16-mixed``: every stage's gradients then carry the scale, which
        the scaler divides out before the optimizer step)."""
        names, values = self._bind(inputs)
        n = int(values[0].shape[0])
        if n % self.m:
            raise ValueError(
                f"a batch of {n} samples does not split into num_micro_batches={self.m} equal "
                f"micro-batches ({n} % {self.m} = {n % self.m}). Fix: a per-rank batch "
                f"size that is a multiple of {self.m} (and drop_last=True on the training DataLoader)."
            )
        key = self._key(names, values, self.m)
        first_step = key not in self._train  # a schedule runs its first step in the call that makes it
        schedule = self._train_schedule(key)
        self._losses, self._scale, self._loss_scale = [], 1.0 / (self.m * accumulate), loss_scale
        args = tuple(v.to(self.device) for v in values) if self.first else ()
        tgt = target.to(self.device) if self.last else None
        # a new schedule in the middle of a step's accumulation (a batch of another shape): its first step would
        # clear the FSDP2 chunks' accumulated gradients
        with self._gradients_kept(add=True) if first_step else contextlib.nullcontext():
            schedule.step(*args, target=tgt, return_outputs=False)
        # the last m: on a schedule's first step torch's shape inference calls the loss once on scratch tensors
        loss = torch.stack(self._losses[-self.m:]).mean() if self.last else torch.zeros((), device=self.device)
        self._losses = []
        return self._from_last(loss.float()) if everywhere else loss.float()

    @torch.no_grad()
    def forward_only(self, inputs: Any) -> Tensor | None:
        """The last stage's output for the whole batch on the last stage's rank (None elsewhere), forward only."""
        names, values = self._bind(inputs)
        m = largest_divisor_at_most(int(values[0].shape[0]), self.m)
        schedule, stages = self._eval_schedule(m, self._key(names, values, m))
        args = tuple(v.to(self.device) for v in values) if self.first else ()
        for stage in stages:  # no gradient reduction after forwards only (module docstring)
            stage.perform_reduce_grad = _no_reduction  # type: ignore[method-assign]
        try:
            with self._gradients_kept(add=False):  # none is made here
                out = schedule.step(*args)
        finally:
            for stage in stages:
                del stage.perform_reduce_grad
        return out if self.last else None

    @contextlib.contextmanager
    def _gradients_kept(self, *, add: bool) -> Generator[None, None, None]:
        """Keep the gradients accumulated so far through a step that may be a schedule's first: that step clears
        every FSDP2 chunk's gradients after its shape inference. The FSDP2 chunks are resharded first (a chunk kept
        gathered after a forward-only step registers its gathered parameters, whose ``.grad`` is not the
        accumulated one) and again after the step, as the schedules' own gradient reduction leaves them; the kept
        gradients are then put back (``add``: added to the step's own, for a training step)."""
        from torch.distributed.fsdp import FSDPModule

        fsdp = [m for _, chunk in self.chunks for m in chunk.modules() if isinstance(m, FSDPModule)]
        for module in fsdp:
            module.reshard()
        kept = [(param, param.grad) for _, chunk in self.chunks for param in chunk.parameters()
                if param.grad is not None] if fsdp else []
        try:
            yield
        finally:
            for module in fsdp:
                module.reshard()
            for param, grad in kept:
                if param.grad is None:
                    param.grad = grad
                elif add and param.grad is not grad:
                    param.grad += grad

    def eval_loss(self, inputs: Any, target: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(loss, output)``: the batch's loss on every pipeline rank; the output only on the last stage's rank."""
        out = self.forward_only(inputs)
        if self.last:
            assert out is not None
            with torch.no_grad():
                loss = plain(self.loss_fn(out, target.to(self.device)).detach()).float()
        else:
            loss = torch.zeros((), device=self.device)
        return self._from_last(loss), out

    def outputs_everywhere(self, out: Tensor | None) -> Tensor:
        """The last stage's output on every pipeline rank (a broadcast of shape, dtype and data over ``pp``)."""
        box = [None if out is None else plain(out.detach()).cpu()]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        value = box[0]
        assert isinstance(value, Tensor)
        return value.to(self.device)

    def _from_last(self, value: Tensor) -> Tensor:
        if self.p > 1:
            dist.broadcast(value, src=self.last_rank, group=self.group)
        return value
