"""Logged values as one device logs them: what a module logs in ``training_step`` is combined over ``dp``.

A module's ``self.log("train_loss", loss)`` (``sync_dist=False``, Lightning's default) under data parallelism logs
each rank's value for its part of the global batch, so rank 0's curve is not the one-device curve (``lp_ddp`` logged
rank 0's half-batch loss, 7e-3 relative off one device, while the weights agreed to 1e-7). While a training step
runs, :func:`global_batch_logs` routes ``self.log`` (and ``log_dict``) so that every floating-point tensor logged
without ``sync_dist`` is first combined over the data-parallel ranks by its ``reduce_fx`` (``mean``: the global
batch's mean, ``sum``, ``max``, ``min``; :func:`~lightning_parallel.parallel.step.reduce_logged_batch`): the calls
are recorded while the step runs and made when it returns, every value of the step combined in ONE all-reduce (one
more per ``max``/``min`` kind), issued without a host synchronisation. In a multi-rank run the non-finite-loss
guard's per-batch numbers ride in that same all-reduce, so logging the global-batch loss costs no collective of its
own (:mod:`lightning_parallel.callbacks.nonfinite`): over the replicas where they are the whole world (dp, ZeRO,
HSDP, cp), over every rank under tensor parallelism (the tp peers of a replica hold its values alike, so the world's
sum is ``tp`` times the replicas' sum: :meth:`~lightning_parallel.parallel.step.TrainStep.reduce_logged_world`).
Left as they are: values logged with ``sync_dist=True`` (Lightning reduces them over every rank, which under model
parallelism is the same mean), with ``rank_zero_only=True`` or ``enable_graph=True``, with a custom ``reduce_fx``,
and anything but a floating-point tensor (a number, a torchmetrics ``Metric``).

As with ``sync_dist=True``, every data-parallel rank must log the same values in the same order (a ``self.log``
under ``if self.global_rank == 0`` would wait for the others at the all-reduce, or mismatch it). Model-parallel
peers (``tp``, ``pp``) hold the same value already (a value that differs between the tp ranks of one replica, such
as a norm of the rank's own shard, is averaged over them too: log it with ``rank_zero_only=True``
to keep rank 0's own value); ``lp_pipeline``/``lp_hybrid`` log their ``train_loss``
themselves, averaged over ``dp``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_parallel.parallel.context_parallel import weigh
from lightning_parallel.parallel.step import logged_reduce_op
from lightning_parallel.parallel.tensor.local import plain

__all__ = ["GlobalBatchLogs", "ReduceBatch", "TokenWeights", "global_batch_logs", "log_options", "training_step_agreed",
           "weighed_loss", "weighed_when_logged"]

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)


def log_options(module: Any, name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> Mapping[str, Any]:
    """A ``log`` call's options: its keywords (the usual call), or positional options bound to ``log``'s signature."""
    return _LOG_SIGNATURE.bind_partial(module, name, value, *args, **kwargs).arguments if args else kwargs


def weighed_when_logged(options: Mapping[str, Any]) -> bool:
    """Whether a value logged with ``options`` (:func:`log_options`) is averaged over the ranks (by the library, or
    by ``sync_dist=True``) with a mean: the values a context-parallel rank weighs by its share of the counted tokens
    before that mean. Not those logged with ``rank_zero_only`` or with ``enable_graph`` and no ``sync_dist`` (a
    rank's own value), or with another ``reduce_fx``."""
    if options.get("rank_zero_only") or (options.get("enable_graph") and not options.get("sync_dist")):
        return False
    return logged_reduce_op(options.get("reduce_fx", "mean")) == "mean"


@dataclass(frozen=True)
class TokenWeights:
    """How a rank weighs its token-mean loss (and the values it logs with a mean) so that every counted token of the
    optimizer step weighs once (the module names its token labels: ``context_parallel_plan()['labels']``).

    ``local``: the multiplier known before any collective -- without ``count`` the whole weight (one dp rank and no
    accumulation window: the cp share ``cp x n_rank / n_batch``); with ``count`` ``dp x cp x n_rank``, still to be
    divided by the global batch's counted tokens ``N_batch`` (the logged values) or, with ``window``, multiplied by
    the window's batches ``accumulation`` and divided by the step's counted tokens ``N_step`` (the loss: Lightning
    divides it by its accumulation). ``count`` (this rank's whole batch's) and ``window`` (its batches' of the step,
    read ahead: :mod:`lightning_parallel.data.step_tokens`) are summed over dp in the step's all-reduce of its logged
    values, each dp rank's numbers held by ``copies`` of its ranks (its cp ranks, or all its model-parallel peers
    over the whole world): no collective of their own."""

    local: Tensor
    count: Tensor | None = None
    window: Tensor | None = None
    accumulation: int = 1
    copies: int = 1
    dp: int = 1

    def share(self, total: Tensor) -> Tensor:
        """The weight of a value once ``total`` (``N_batch``) is known: ``local / N_batch``, 1 where ``N_batch = 0``
        (the value is then one device's, NaN for a token mean)."""
        if self.count is None:
            return self.local
        return torch.where(total > 0, self.local / total.clamp(min=1), 1.0)

    def numbers(self) -> Tensor | None:
        """What is summed over the ranks: ``[count]`` or ``[count, window]`` (float32), None without ``count``."""
        if self.count is None:
            return None
        count = self.count.to(torch.float32).reshape(1)
        return count if self.window is None else torch.cat((count, self.window.to(count)))

    def loss_weight(self, summed: Tensor) -> Tensor:
        """The loss's whole weight once ``summed`` (:meth:`numbers` summed over the ranks) is known: ``local /
        N_batch``, or ``local x k / N_step`` with a window (``k``: :attr:`accumulation`, the window's batches), in
        one division -- so where every batch counts as many tokens it is exactly 1; 0 where nothing is counted (a
        step without any counted token contributes nothing: one device's loss would be NaN)."""
        total = summed[-1] / self.copies
        local = self.local if self.window is None else self.local * self.accumulation
        return local / total.clamp(min=1)

    def own_share(self) -> Tensor:
        """This rank's weight as if its batch were the only one (``local / (dp x n_batch)``: the cp share, or 1): the
        loss the non-finite guard checks -- its own token mean, 0 where it counts nothing."""
        if self.count is None:
            return self.local
        return self.local / (self.count * self.dp).clamp(min=1)


ReduceBatch = Callable[[Sequence[tuple[Tensor, Any]], Tensor | None], tuple[list[Tensor], Tensor | None]]
"""``(values with their reduce_fx, extra) -> (combined values, extra summed)``: e.g.
:meth:`~lightning_parallel.parallel.step.TrainStep.reduce_logged_batch`."""


class GlobalBatchLogs:
    """While open (a ``with`` block around a training step), ``module.log`` calls are recorded; :meth:`finish` combines
    every floating-point value over dp in one all-reduce (per reduction kind and dtype) -- with ``extra`` numbers
    riding along, e.g. the non-finite-loss guard's -- and then makes the recorded ``log`` calls, in their order, with
    the combined values. Without :meth:`finish` the block's end does it (no ``extra``); an exception in the block drops
    the recorded calls. ``reduce`` None (one dp rank, nothing to combine): ``log`` is left as it is.

    The values are recorded, not logged, until the step returns: a training step that logs a value and then reads it
    back from ``trainer.callback_metrics`` in the same step sees the previous step's.

    ``tokens`` (the module names its token labels, :class:`TokenWeights`): every value averaged with a mean
    (:func:`weighed_when_logged`) is multiplied by its ``local`` weight first and, when the weight waits for the
    global batch's count, divided by that count once the all-reduce has summed it (the counts ride in it:
    :attr:`token_numbers`)."""

    def __init__(self, module: Any, reduce: ReduceBatch | None, tokens: TokenWeights | None = None) -> None:
        self.module, self.reduce, self.tokens = module, reduce, tokens
        self._calls: list[tuple[str, Any, tuple[Any, ...], dict[str, Any], Any, bool]] = []
        self._previous: Any = None
        self._had_own = False
        self._open = False
        self.token_numbers: Tensor | None = None
        """``tokens.numbers()`` summed over the ranks in :meth:`finish` (with ``tokens.count``)."""

    def __enter__(self) -> GlobalBatchLogs:
        module = self.module
        if module is None or self.reduce is None:
            return self
        self._had_own = "log" in vars(module)
        self._previous = module.log
        self._calls = []
        calls, tokens = self._calls, self.tokens
        waits = tokens is not None and tokens.count is not None  # weighed values are divided by the total later

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            fx, weighed = None, False
            if isinstance(value, Tensor) and value.is_floating_point():
                bound = log_options(module, name, value, args, kwargs)
                if tokens is not None and weighed_when_logged(bound):
                    value = weigh(plain(value if bound.get("enable_graph") else value.detach()), tokens.local)
                    weighed = waits
                if not (bound.get("sync_dist") or bound.get("rank_zero_only") or bound.get("enable_graph")):
                    fx, value = bound.get("reduce_fx", "mean"), plain(value.detach())
            calls.append((name, value, args, kwargs, fx, weighed))

        module.log = log
        self._open = True
        return self

    def finish(self, extra: Tensor | None = None) -> Tensor | None:
        """Combine the recorded values (one all-reduce, ``extra`` summed in it) and log them; returns ``extra``
        summed over dp (``extra`` as it is when ``log`` was not routed: one rank)."""
        if not self._open:
            return extra
        self._restore()
        assert self.reduce is not None
        tokens = self.tokens
        numbers = tokens.numbers() if tokens is not None else None
        if numbers is not None and extra is not None:
            numbers = torch.cat((extra, numbers.to(extra.device)))
        reduced = [i for i, call in enumerate(self._calls) if call[4] is not None]
        values, summed = self.reduce([(self._calls[i][1], self._calls[i][4]) for i in reduced],
                                     extra if numbers is None else numbers)
        inverse = None
        if numbers is not None:
            assert tokens is not None and summed is not None
            mine = 1 if tokens.window is None else 2
            self.token_numbers = summed[-mine:]
            summed = summed[:-mine] if extra is not None else None
            total = self.token_numbers[0] / tokens.copies  # the global batch's counted tokens
            inverse = torch.where(total > 0, 1.0 / total.clamp(min=1), math.nan)  # one device's mean of nothing
        combined = dict(zip(reduced, values, strict=True))
        for i, (name, value, args, kwargs, _, weighed) in enumerate(self._calls):
            value = combined.get(i, value)
            self._previous(name, value * inverse if weighed and inverse is not None else value, *args, **kwargs)
        self._calls.clear()
        return summed

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if not self._open:
            return
        if kind is None:
            self.finish()
        else:
            self._restore()
            self._calls.clear()

    def _restore(self) -> None:
        self._open = False
        if self._had_own:
            self.module.log = self._previous
        else:
            del self.module.log


def global_batch_logs(module: Any, reduce: ReduceBatch | None, tokens: TokenWeights | None = None
                      ) -> GlobalBatchLogs:
    """While open, ``module.log`` combines what it logs over dp (module docstring) with ``reduce``, batched at the
    block's end (:class:`GlobalBatchLogs`); ``reduce`` None (one dp rank) changes nothing."""
    return GlobalBatchLogs(module, reduce, tokens)


def training_step_agreed(module: Any, step: Callable[[], Any], reduce: ReduceBatch | None, guard: Any | None, *,
                         tokens: TokenWeights | None = None) -> Any:
    """Run ``step`` (the module's training step) with its logged values combined over dp (:class:`GlobalBatchLogs`)
    and, when ``guard`` (a :class:`~lightning_parallel.callbacks.NonFiniteLossGuard`) is given -- ``reduce`` then
    all-reduces over every rank --, the guard's numbers of this batch summed in the same all-reduce: one collective
    per batch for both, where Lightning broadcasts its preemption flag. ``tokens`` (the module names its token
    labels): the step's loss and its mean-logged values are weighed by this rank's share of the global batch's
    counted tokens (:class:`TokenWeights`; the global count summed in the same all-reduce), so the mean over the
    replicas is the mean over every counted token. Returns what ``step`` returns (its loss weighed)."""
    with global_batch_logs(module, reduce, tokens) as logs:
        out = step()
        counts = tokens is not None and tokens.count is not None
        if tokens is not None and not counts:
            out = weighed_loss(out, tokens.local)
        numbers = None
        if guard is not None and reduce is not None:
            # the guard sees each rank's own token mean (0 where it counts none), not the weight still to be known
            numbers = guard.local_numbers(module.trainer, weighed_loss(out, tokens.own_share()) if counts
                                          and tokens is not None else out)
        summed = logs.finish(numbers)
        if counts:
            assert tokens is not None
            # one replica (nothing to sum, no routed logs): this rank's own numbers are the totals
            totals = logs.token_numbers if reduce is not None else tokens.numbers()
            assert totals is not None
            out = weighed_loss(out, tokens.loss_weight(totals))
    if guard is not None and numbers is not None and summed is not None:
        guard.agree(summed)
    return out


def weighed_loss(out: Any, share: Tensor) -> Any:
    """A training step's output with its loss (the tensor, or a dict's ``"loss"``) multiplied by ``share``; a
    tensor-parallel loss (a replicated DTensor) as its local tensor, keeping its graph."""
    if isinstance(out, Tensor):
        return weigh(plain(out), share)
    if isinstance(out, dict) and isinstance(out.get("loss"), Tensor):
        return {**out, "loss": weigh(plain(out["loss"]), share)}
    return out
