"""``lp_dp`` (alias ``dp``): single-process, thread-based data parallel for Lightning 2 (Lightning 1.x's ``dp``).

One process drives ``N`` devices (``Trainer(strategy="dp", devices=N)``): ``cuda:0..N-1`` on GPUs, ``N`` CPU replicas
on CPU. Every ``training_step``/``validation_step``/``test_step``/``predict_step`` runs through
:class:`~lightning_parallel.parallel.data_parallel.DataParallelEngine`:

* forward: the batch, moved to device 0 by Lightning, is **scattered** by samples (slice sizes differ by at most
  one; with fewer samples than devices only that many replicas run); the module is **replicated** to every device
  (autograd-aware copies of the latest weights); each replica runs the user's step on its slice in its own thread;
  the outputs are **gathered** on device 0: the loss (and every other mean-like value) as the mean weighted by slice
  size, so it equals one device on the whole batch; per-sample tensors are concatenated;
* backward (Lightning's ``loss.backward()`` on device 0): the loss gradient is **scattered** back to the replicas,
  each replica's backward runs (in its own thread on CPU), and their gradients are **reduced** (summed) into the
  master parameters' ``.grad`` on device 0;
* the optimizer steps once, on device 0; checkpoints hold the plain module's ``state_dict`` (there is no wrapper).

``self.log`` inside a step is recorded per replica (no shared state, no races) and replayed once on the master module
after the step, each value reduced over the replicas by its ``reduce_fx`` (``mean``: weighted by slice size, ``sum``,
``max``, ``min``). With ``count_exchanges=True`` the exchanges of every training step are counted in
:attr:`LPDPStrategy.exchange_counter`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from numbers import Number
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor, nn
from typing_extensions import override

from lightning_parallel.parallel.counters import GATHER_OUTPUTS, CommCounter, tensor_bytes
from lightning_parallel.parallel.data_parallel import BackwardMode, DataParallelEngine, Reduction

from .resumable import ResumableDataMixin

__all__ = ["LPDPStrategy"]

_STEP_CONTEXTS = {
    "training_step": "train_step_context",
    "validation_step": "val_step_context",
    "test_step": "test_step_context",
    "predict_step": "predict_step_context",
}


class _LogRecorder:
    """Stands in for ``LightningModule.log`` on one replica: records the calls, logs nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]] = []

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (Tensor, Number)):
            raise ValueError(
                f"lp_dp: self.log({name!r}, <{type(value).__name__}>) inside a step runs on a replica; only tensors "
                "and numbers can be combined over the replicas. Fix: log a tensor or a float (e.g. metric.compute() "
                "in an epoch-end hook), or update stateful metrics from outputs in on_train_batch_end."
            )
        self.calls.append((name, value, args, kwargs))


def _metric_type() -> type | None:
    try:
        from torchmetrics import Metric
    except ImportError:
        return None
    return Metric  # type: ignore[no-any-return]


def _keep_reassigned_buffers(module: nn.Module, replica: nn.Module) -> None:
    """A buffer the step reassigned on the first replica (``self.count = self.count + 1``, not in place) becomes the
    module's, as DDP keeps rank 0's buffers: the first replica shares the module's buffer objects, so an in-place
    update reaches the module already, a reassignment only the replica (it was lost: 0.0 where one device counts 6)."""
    for mine, theirs in zip(module.modules(), replica.modules(), strict=False):
        for key, buf in mine._buffers.items():
            if key not in theirs._buffers:
                continue
            new = theirs._buffers[key]
            if new is not buf:
                mine._buffers[key] = new.detach() if isinstance(new, Tensor) else new  # None kept as None


def _combine_logged(values: list[Tensor], weights: list[float], reduce_fx: Any) -> Tensor:
    """One value from the replicas' values of one metric, by the metric's ``reduce_fx``."""
    dtype = torch.float64 if any(v.dtype == torch.float64 for v in values) else torch.float32  # 64-true keeps fp64
    stacked = torch.stack([v.to(dtype) for v in values])
    name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "mean")
    if name in ("sum", "add"):
        return stacked.sum(0)
    if name in ("max", "amax"):
        return stacked.amax(0)
    if name in ("min", "amin"):
        return stacked.amin(0)
    w = torch.tensor(weights, dtype=stacked.dtype, device=stacked.device).view(-1, *([1] * (stacked.dim() - 1)))
    return (stacked * w).sum(0)


class LPDPStrategy(ResumableDataMixin, ParallelStrategy):
    """Thread-based data parallel in one process: Lightning 1.x's ``strategy="dp"`` for Lightning 2.

    Args:
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as for every Lightning strategy; the
            Trainer's ``accelerator``/``devices`` fill ``parallel_devices`` (``[cpu] * N`` or ``cuda:0..N-1``).
        loss_reduction: what the loss is over a slice: ``mean`` (the mean over its samples, Lightning's usual
            case; combined as the slice-size weighted mean) or ``sum`` (combined as the sum).
        cpu_threads: intra-op threads per replica thread on CPU; None = cores // devices (at least 1), 0 = leave
            PyTorch's setting alone.
        backward: how the replicas' backward runs: ``threads`` (each replica's backward in its own thread, then
            the leaf gradients summed on device 0), ``graph`` (one autograd graph through torch-style replicas, as
            torch's DataParallel), ``auto`` = threads on CPU (where one backward call runs on one thread), graph on
            GPUs (where PyTorch already runs each device's backward on its own thread). Both give the same result.
        count_exchanges: count the five exchanges of every training step in :attr:`exchange_counter` (calls and
            bytes per kind); off by default, so a step runs no counting code.
    """

    strategy_name = "lp_dp"
    skips_nonfinite_steps = True

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        loss_reduction: Reduction = "mean",
        cpu_threads: int | None = None,
        backward: BackwardMode = "auto",
        count_exchanges: bool = False,
    ) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r} is not one of ['mean', 'sum'].")
        if cpu_threads is not None and cpu_threads < 0:
            raise ValueError(f"cpu_threads={cpu_threads} must be >= 0 (0 = leave PyTorch's setting alone).")
        if backward not in ("auto", "threads", "graph"):
            raise ValueError(f"backward={backward!r} is not one of ['auto', 'threads', 'graph'].")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=None,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._loss_reduction: Reduction = loss_reduction
        self._cpu_threads = cpu_threads
        self._backward: BackwardMode = backward
        self._engine: DataParallelEngine | None = None
        self._saved_threads: int | None = None
        self.exchange_counter: CommCounter | None = CommCounter() if count_exchanges else None
        """The exchanges of the training steps, with ``count_exchanges=True`` or :meth:`count_communication`."""

    # ------------------------------------------------------------------ one process, N devices
    @property
    @override
    def global_rank(self) -> int:
        return 0

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    def num_replicas(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[0] if self.parallel_devices else torch.device("cpu")

    @property
    def engine(self) -> DataParallelEngine:
        if self._engine is None:
            raise RuntimeError("LPDPStrategy.engine exists after setup(); the Trainer has not set it up yet.")
        return self._engine

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # one process reads every batch whole; the engine splits it

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            raise ValueError(
                f"lp_dp runs each step on {self.num_replicas} replicas in threads and needs automatic optimization; "
                f"{type(module).__name__}.automatic_optimization is False (manual_backward would run per replica). "
                "Fix: use automatic optimization, or strategy lp_ddp."
            )
        if self._layer_sync is not None:
            raise ValueError(
                "lp_dp cannot synchronise BatchNorm statistics across its replicas (Trainer(sync_batchnorm=True) needs "
                "one process per device). Fix: drop sync_batchnorm (each replica then normalises its slice), or use "
                "strategy lp_ddp with sync_batchnorm=True on GPUs (torch's SyncBatchNorm runs on GPUs only)."
            )
        devices = self.parallel_devices or [self.root_device]
        self._saved_threads = torch.get_num_threads()
        self._engine = DataParallelEngine(devices, reduction=self._loss_reduction, cpu_threads=self._cpu_threads,
                                          counter=self.exchange_counter, backward=self._backward)
        super().setup(trainer)

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None
        super().teardown()

    # ------------------------------------------------------------------ the steps
    def _run(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Scatter the batch (``args[0]``), run ``method`` on every replica in threads, gather, replay the logs."""
        module = self.lightning_module
        assert module is not None
        engine = self.engine
        if not args:
            raise ValueError(f"lp_dp: {method} was called without a batch.")
        slices, sizes = engine.scatter(args[0])
        replicas, plan = engine.replicate(module, len(slices))
        recorders = [_LogRecorder() for _ in replicas]
        for device, replica, recorder in zip(engine.devices, replicas, recorders, strict=False):
            object.__setattr__(replica, "log", recorder.log)  # log_dict goes through log too
            if hasattr(replica, "_device"):
                object.__setattr__(replica, "_device", device)
        context: Callable[[], Any] = getattr(self.precision_plugin, _STEP_CONTEXTS[method])

        def call(i: int) -> Any:
            with context():
                return getattr(replicas[i], method)(slices[i], *args[1:], **kwargs)

        training = method == "training_step"
        window = self.step_tokens.take() if training and self.step_tokens is not None else None  # one per batch
        weights = self._token_weights(slices, sizes, optional=not training, window=window) \
            if method != "predict_step" else None
        # the precision's step context runs in each replica's thread (autocast is per thread); bf16-true's also sets
        # torch's default dtype, which is per process: the threads' exits would restore one another's bf16, so the
        # dtype the step started with is put back once, here
        default_dtype = torch.get_default_dtype()
        metrics = self._metric_updates(module)
        try:
            outputs = engine.apply(call, len(slices))
        finally:
            torch.set_default_dtype(default_dtype)
        self._check_metric_updates(module, metrics, method)
        _keep_reassigned_buffers(module, replicas[0])
        if weights is not None:
            outputs = self._weighed(module, outputs, recorders, *weights, loss=training)
        result = engine.gather(outputs, sizes, plan=plan, force_reduce=method == "training_step")
        self._replay_logs(module, recorders, sizes)
        return result

    @staticmethod
    def _metric_updates(module: pl.LightningModule) -> list[tuple[Any, int]]:
        """The module's torchmetrics ``Metric`` submodules with their update counts, before a step (looked for at
        every step: a hook may add a metric during the fit)."""
        metric_type: Any = _metric_type()
        if metric_type is None:
            return []
        return [(m, int(m._update_count)) for m in module.modules() if isinstance(m, metric_type)]

    @staticmethod
    def _check_metric_updates(module: pl.LightningModule, before: list[tuple[Any, int]], method: str) -> None:
        """Refuse a torchmetrics ``Metric`` updated inside a step: its ``update`` is bound to the module's metric
        object, so every replica's thread updated that one object at once (values not one device's: a metric called
        in the step logged 0.4756 where one device logs 0.6126)."""
        changed_ids = {id(metric) for metric, count in before if int(metric._update_count) != count}
        changed = [name for name, m in module.named_modules() if id(m) in changed_ids]
        if changed:
            stage = {"training_step": "train"}.get(method, method.replace("_step", ""))
            raise ValueError(
                f"lp_dp: the torchmetrics metric {changed[0]!r} was updated inside {method}: it runs on every replica "
                "in its own thread, and a Metric's update is bound to the module's one metric object, so the "
                "replicas updated it at once with their own slices (not one device's values). Fix: update it from "
                f"the step's combined outputs in on_{stage}_batch_end (Lightning passes them as `outputs`), or run "
                "under lp_ddp.")

    def _token_weights(self, slices: list[Any], sizes: list[int], *, optional: bool,
                       window: tuple[int, int] | None = None) -> tuple[list[Tensor], list[Tensor]] | None:
        """With the module's token labels named (``context_parallel_plan()['labels']``): each replica's multipliers
        of its logged values, ``n_i / N x B / b_i`` (``n_i`` counted tokens of its slice, ``N`` of the batch; ``b_i``
        its samples of ``B``), so their sample-weighted mean becomes the mean over every counted token, and of its
        loss: the same, or with an accumulation window (``window``: the counted tokens of the optimizer step's
        batches, read ahead, and the ``k`` > 1 batches it holds) ``k x n_i / N_step x B / b_i``, so every token of
        the step weighs once (Lightning divides the loss by its accumulation). None otherwise, and for a batch
        without the labels entry when ``optional`` (an evaluation batch). No host synchronisation."""
        from lightning_parallel.parallel.context_parallel import counted_tokens, token_share

        module = self.lightning_module
        if module is None:
            return None
        accumulation = 1 if window is None else window[1]
        if len(slices) == 1 and accumulation == 1:
            return None
        labels = self.token_labels()
        if labels is None:
            return None
        try:
            counts = [counted_tokens(part, labels) for part in slices]
        except ValueError:
            if optional:
                return None
            raise
        total = torch.stack([c.to(self.root_device) for c in counts]).sum()
        whole = sum(sizes)
        # one division each (n_i B / (N b_i)): exactly 1 where every sample counts as many tokens
        logged = [token_share(c * whole, total.to(c.device) * b, 1) for c, b in zip(counts, sizes, strict=True)]
        if accumulation == 1 or window is None:
            return logged, logged
        step = torch.full_like(total, window[0])
        loss = [token_share(c * (accumulation * whole), step.to(c.device) * b, 1)
                for c, b in zip(counts, sizes, strict=True)]
        return loss, logged

    @staticmethod
    def _weighed(module: pl.LightningModule, outputs: list[Any], recorders: list[_LogRecorder],
                 weights: list[Tensor], logged: list[Tensor], *, loss: bool) -> list[Any]:
        """Each replica's loss (``loss``: a training step's; by ``weights``) and the values it logged with a mean (by
        ``logged``) multiplied by its token weights (:meth:`_token_weights`)."""
        from lightning_parallel.parallel.context_parallel import weigh

        from .logged import log_options, weighed_loss, weighed_when_logged

        for recorder, weight in zip(recorders, logged, strict=True):
            for i, (name, value, args, kwargs) in enumerate(recorder.calls):
                if isinstance(value, Tensor) and value.is_floating_point() \
                        and weighed_when_logged(log_options(module, name, value, args, kwargs)):
                    recorder.calls[i] = (name, weigh(value, weight.to(value.device)), args, kwargs)
        if not loss:
            return outputs
        return [weighed_loss(out, weight) for out, weight in zip(outputs, weights, strict=True)]

    def _replay_logs(self, module: pl.LightningModule, recorders: list[_LogRecorder], sizes: list[int]) -> None:
        """Each metric logged on the replicas, reduced over them, logged once on the master module."""
        by_name: dict[str, list[tuple[int, Any, tuple[Any, ...], dict[str, Any]]]] = {}
        for i, recorder in enumerate(recorders):
            for name, value, args, kwargs in recorder.calls:
                by_name.setdefault(name, []).append((i, value, args, kwargs))
        moved = 0
        for name, entries in by_name.items():
            keep_graph = bool(entries[0][3].get("enable_graph"))
            values = [torch.as_tensor(v).to(self.root_device) for _, v, _, _ in entries]
            values = values if keep_graph else [v.detach() for v in values]
            moved += sum(tensor_bytes(v) for v in values[1:])
            weights = [sizes[i] / max(1, sum(sizes[j] for j, *_ in entries)) for i, *_ in entries]
            _, _, args, kwargs = entries[0]
            kwargs = dict(kwargs)
            if kwargs.get("batch_size") is not None:
                kwargs["batch_size"] = sum(int(e[3].get("batch_size") or 0) for e in entries)
            value = _combine_logged(values, weights, kwargs.get("reduce_fx", "mean"))
            value = value.to(values[0].dtype) if values[0].is_floating_point() else value
            pl.LightningModule.log(module, name, value, *args, **kwargs)
        if moved and self.exchange_counter is not None and self.exchange_counter.enabled and len(recorders) > 1:
            self.exchange_counter.record(GATHER_OUTPUTS, moved)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("training_step", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("predict_step", args, kwargs)

    # ------------------------------------------------------------------ exchange counting (opt-in): training only
    def count_communication(self) -> CommCounter:
        """Count the exchanges of every training step from now on (validation, test and predict are not counted) in
        :attr:`exchange_counter`; off by default (a step then runs no counting code). Call before ``fit``."""
        if self.exchange_counter is None:
            self.exchange_counter = CommCounter()
        return self.exchange_counter

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.exchange_counter is not None:
            self.exchange_counter.step()

    def _counting(self, on: bool) -> None:
        if self.exchange_counter is not None:
            self.exchange_counter.enabled = on

    @override
    def on_validation_start(self) -> None:
        self._counting(False)

    @override
    def on_validation_end(self) -> None:
        self._counting(True)

    @override
    def on_test_start(self) -> None:
        self._counting(False)

    @override
    def on_test_end(self) -> None:
        self._counting(True)

    @override
    def on_predict_start(self) -> None:
        self._counting(False)

    @override
    def on_predict_end(self) -> None:
        self._counting(True)

    # ------------------------------------------------------------------ one process: collectives are identities
    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Identity: the values are already combined once on device 0 (there is one process)."""
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        pass

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Any:
        yield None

    def on_train_start(self) -> None:
        """The RNG states of a resumed checkpoint are set here, after the training iterator exists."""
        from lightning_parallel.callbacks.nonfinite import install as install_nonfinite_guard
        from lightning_parallel.checkpoint.rng import apply_restored_rng_states

        super().on_train_start()
        apply_restored_rng_states()
        if self.lightning_module is not None:
            install_nonfinite_guard(self.lightning_module.trainer)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step; a step the ``NonFiniteLossGuard`` skips ends before the update (a gradient
        scaler records the skip)."""
        from lightning_parallel.callbacks.nonfinite import SkippedStep
        from lightning_parallel.parallel.scaler import after_skipped_step

        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        except SkippedStep:
            after_skipped_step(getattr(self.precision_plugin, "scaler", None), optimizer)
            return None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's one-file save, with the RNG states added."""
        from lightning_parallel.checkpoint.formats import lightning_file

        lightning_file.save(self, checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Any checkpoint the library writes, joined into the one-device form (what this one process holds)."""
        from lightning_parallel.checkpoint.resume import resume_one_device

        return resume_one_device(self, checkpoint_path)

    def describe(self) -> str:
        kind = self.root_device.type
        return f"{self.strategy_name} (1 process, {self.num_replicas} {kind} replicas in threads)"

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model  # no wrapper: the module is the master copy on device 0; replicas are made per step
