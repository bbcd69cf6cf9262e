"""``ZeroOptimizer``: ZeRO stages 1 and 2 over the ``dp`` process group, around any torch optimizer.

What is sharded along ``dp`` (``N`` ranks, ``Psi`` parameters, ``P``/``G`` bytes per parameter and gradient element,
``K`` bytes of optimizer state per parameter; the formulas of ``docs/formulas.md``, "ZeRO: model-state memory per
device"):

* stage 1 -- optimizer states. Each rank steps only its ``1/N`` flat shard of every param group (see
  :class:`~lightning_parallel.parallel.zero.flat.FlatShard`). Per rank: ``P Psi + G Psi + K Psi / N``.
* stage 2 -- optimizer states and gradients. Only the ``1/N`` gradient shard persists. Per rank:
  ``P Psi + (G + K) Psi / N``.

Collectives (none in forward; gradients accumulate locally in backward, also across accumulation micro-batches):
at the step boundary :meth:`ZeroOptimizer.reduce_gradients` reduce-scatters each group's flat gradient (the mean of
the ranks' gradients, ``(N-1)/N * G Psi`` bytes sent per rank) -- or, at stage 2 after
:meth:`ZeroOptimizer.overlap_backward` (the strategies arm the step's last backward), the backward itself reduces
each rank's chunk to that rank as it completes it and frees the gradients sent (the same bytes, in ``N`` reduces of
a chunk, overlapping the rest of the backward: :mod:`~lightning_parallel.parallel.zero.overlap`); after the inner
optimizer's step,
:meth:`ZeroOptimizer.step` all-gathers the updated parameter shards into every rank's full flat buffer
(``(N-1)/N * P Psi``): ``2 Psi (N-1)/N`` elements per step, the same volume as DDP's all-reduce.

The user's optimizer object is kept and modified in place: each of its param groups holds one flat shard parameter
instead of the group's parameters, so LR schedulers (which hold a reference to that object and write
``param_groups[i]["lr"]``) keep working; the wrapper's ``param_groups``, ``state`` and ``defaults`` are the inner
optimizer's (properties, never copies).
No Lightning import.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from .comm import all_gather_into, reduce_scatter_mean
from .flat import FlatShard, hook_trainable
from .overlap import ChunkedReduce

__all__ = ["ZeroOptimizer"]

_SHARDED_FORMAT = "lightning_parallel.zero.sharded.v1"


_SHARD_GRADIENT_CLEARED = (
    "the ZeRO-1/2 shard's gradient is gone: the optimizer object configure_optimizers made was zeroed (or stepped) "
    "by itself. Under ZeRO-1/2 that object is the inner optimizer over this rank's flat shard; its zero_grad() "
    "drops the shard's gradient and its step() skips the reduction over the data-parallel ranks. Fix: under "
    "manual optimization call zero_grad() and step() on what self.optimizers() returns (Lightning's wrapper of the "
    "ZeRO optimizer), as under automatic optimization.")


def _refuse_added_group(stage: int, param_group: dict[str, Any]) -> None:
    names = sorted({k for k in param_group if k != "params"})
    raise RuntimeError(
        f"add_param_group({{'params': ..., {', '.join(repr(n) for n in names)}}}) on a ZeRO-{stage} optimizer: its "
        "param groups are flat buffers sharded over the data-parallel ranks, made once when the fit starts, so a "
        "group added later would be stepped with each rank's own gradient (not the average) and the replicas would "
        "drift apart. Fix: give configure_optimizers every parameter from the start -- the layers to unfreeze later "
        "in a group of their own with their requires_grad=False (or lr 0 until then) -- or use zero_stage=3 or "
        "lp_ddp, which take groups added during the fit.")


class ZeroOptimizer(Optimizer):
    """Shard ``optimizer`` (and, at stage 2, the gradients) over ``group``.

    Args:
        optimizer: a freshly built torch optimizer (no state yet) over the model's parameters, any param groups.
        stage: 1 (optimizer states) or 2 (optimizer states and gradients).
        group: the ``dp`` process group (None = the default group).
    """

    def __init__(self, optimizer: Optimizer, *, stage: int, group: dist.ProcessGroup | None = None) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer runs ZeRO stage 1 or 2, got stage={stage}; stage 3 is apply_zero3().")
        if isinstance(optimizer, ZeroOptimizer):
            raise ValueError("the optimizer is already a ZeroOptimizer.")
        if not all(_never_stepped(s) for s in optimizer.state.values()):
            raise ValueError("ZeroOptimizer needs an optimizer that has not stepped yet; wrap it before the first "
                             "step.")
        # Optimizer.__init__ is not called on purpose: the wrapper owns no param groups of its own.
        self.optim = optimizer
        self.stage, self.group = stage, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.shards: list[FlatShard] = []
        for pg in optimizer.param_groups:
            params = list(pg["params"])
            shard = FlatShard(params, world_size=self.world_size, rank=self.rank, keep_full_grad=(stage == 1))
            pg["params"] = [shard.shard_param]
            self.shards.append(shard)
            _flatten_initial_state(optimizer, params, shard)
        # stage 2: the chunks of the gradient reduced during an armed backward (overlap_backward)
        self._chunked = ChunkedReduce(self.shards, group) if stage == 2 and self.world_size > 1 else None
        # which parameters received a gradient since the last step (autograd's hooks), and where each lies in this
        # rank's shard: a parameter without one is left as it was by the step (see _hold_unused)
        self._usage = _Usage(self.shards)
        self._spans = [_spans_in_shard(shard) for shard in self.shards]
        # the user's object too (a function holding no reference to this wrapper: a dropped wrapper is freed)
        optimizer.add_param_group = functools.partial(_refuse_added_group, stage)  # type: ignore[method-assign]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: each param group is one flat buffer sharded over dp, made when the wrapper is built. torch's
        ``add_param_group`` appended the group's whole parameters to the inner optimizer, which then stepped them
        with each rank's own local gradient: silently not one device's training, and the replicas drifted apart
        (a backbone unfrozen in ``on_train_epoch_start``: 3.2e-01 from one device, the two ranks 3.4e-01 apart)."""
        _refuse_added_group(self.stage, param_group)

    @property
    def _grads_reduced(self) -> bool:
        """Whether this step's gradients were reduced (since the last step or ``zero_grad``), read off the shards.
        Nothing of a step's progress is assigned to ``self``: Lightning's ``LightningOptimizer`` is an instance of a
        subclass of this class that forwards missing attributes to the optimizer it wraps, so these methods also run
        with a wrapper as ``self`` (manual optimization's ``opt.zero_grad()``, ``opt.clip_grad_norm_()``), and an
        attribute assigned there would be the wrapper's alone (a gradient then reduced twice)."""
        return any(shard.reduced is not None for shard in self.shards)

    # shared with the inner optimizer (which may replace them, e.g. in load_state_dict), never copied
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optim.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optim.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optim.defaults = value

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.stage}, world_size={self.world_size}, optim={self.optim!r})"

    @property
    def optimizer(self) -> Optimizer:
        """The user's optimizer inside, under the name DeepSpeed's optimizers give theirs: Lightning's
        ``LearningRateMonitor`` unwraps it, and so names and reads the learning rates as on one device (``lr-AdamW``,
        once, where it logged ``lr-ZeroOptimizer`` beside the scheduler's ``lr-AdamW``)."""
        return self.optim

    def model_parameters(self) -> list[Tensor]:
        """The module's parameters this optimizer steps, in param-group order (its ``param_groups`` hold one flat
        shard per group instead)."""
        return [p for shard in self.shards for p in shard.params]

    def reduced_gradient_pieces(self) -> list[tuple[Tensor, bool, Tensor | None, Tensor | None]]:
        """This step's reduced gradient as it lies in this rank's shards, for reading it (a gradient norm): per
        module parameter (:meth:`model_parameters` order), whether this rank gave it a gradient since the last step,
        its slice of this rank's reduced shard (None when the shard holds none of it) and that slice's weight (None:
        1; under tensor parallelism ``1/t`` for elements the tp ranks hold alike). Raises before the step's
        gradients are reduced."""
        if not self._grads_reduced:
            raise ValueError(
                "the ZeRO-1/2 optimizer does not hold the step's reduced gradient yet (each rank holds its own, not "
                "yet averaged): read it after the reduction, e.g. in on_before_optimizer_step.")
        weights: list[Tensor] | None = getattr(self, "_weights", None)
        params = self.model_parameters()
        pieces: list[tuple[Tensor, bool, Tensor | None, Tensor | None]] = []
        for s, shard in enumerate(self.shards):
            grad, used = shard.shard_param.grad, self._usage.used[s]
            spans = {i: (lo, hi) for i, lo, hi in self._spans[s]}
            for i in range(len(shard.params)):
                span = spans.get(i)
                if span is None or grad is None:
                    pieces.append((params[len(pieces)], used[i], None, None))
                    continue
                lo, hi = span
                pieces.append((params[len(pieces)], used[i], grad[lo:hi],
                               weights[s][lo:hi] if weights is not None else None))
        return pieces

    # ------------------------------------------------------------------ the step
    def overlap_backward(self) -> None:
        """Stage 2: the next backward reduces each rank's chunk of the gradient as it completes it and frees the
        gradients sent (:class:`~lightning_parallel.parallel.zero.overlap.ChunkedReduce`), so the step's whole
        gradient never exists at once; call it before the step's last backward (and, to reduce every accumulation
        micro-batch as it goes -- ``reduce_each_batch`` -- before each of theirs: the rounds add up), then
        :meth:`reduce_gradients` as always. Nothing at stage 1 or on one rank."""
        if self._chunked is not None:
            self._chunked.arm()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter every group's flat gradient: this rank's shard holds the mean over the dp ranks (after an
        armed backward, :meth:`overlap_backward`: the chunks it has sent, and any it left).

        Call once per optimizer step, after the last backward of the accumulation window (``step`` calls it if
        nobody did); gradient clipping must come after it.
        """
        chunks = self._chunked.finish() if self._chunked is not None else None
        for k, shard in enumerate(self.shards):
            for i in shard.params_with_own_grad():  # set by hand, not by autograd: no hook ran (see _Usage)
                self._usage.used[k][i] = True
            grad = shard.shard_param.grad
            if grad is None:
                raise RuntimeError(_SHARD_GRADIENT_CLEARED)
            # a further reduction in the same step (manual optimization, several backwards) adds to the first
            earlier = shard.reduced
            if chunks is not None:
                out = chunks[k].div_(self.world_size)
            else:
                full = shard.full_local_grad()
                if earlier is not None and shard.flat_grad is not None:
                    shard.shard_of(full).sub_(earlier)  # ZeRO-1: this slot holds earlier + the new local gradient
                out = torch.empty(shard.shard_numel, dtype=full.dtype, device=full.device)
                reduce_scatter_mean(out, full, group=self.group)
            if earlier is not None:
                out.add_(earlier)
            grad.copy_(out)
            shard.reduced = out  # released by step() / zero_grad()
            shard.release_full_grad()

    @torch.no_grad()
    def all_gather_params(self) -> None:
        """Every rank's updated shard into every rank's full flat parameter buffer (the model's parameters)."""
        for shard in self.shards:
            all_gather_into(shard.flat, shard.shard_of(shard.flat), group=self.group)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (forward + backward), reduce-scatter gradients, step the shards (leaving the parameters that
        received no gradient as they were: :meth:`_hold_unused`), all-gather parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._grads_reduced:
            self.reduce_gradients()
        held = self._hold_unused()
        self.optim.step()
        self._put_back(held)
        for shard in self.shards:
            shard.reduced = None
        self._usage.reset()
        self.all_gather_params()
        return loss

    # ------------------------------------------------------------------ parameters without a gradient
    def _put_back(self, held: list[tuple[int, Any, int, int, Tensor, Tensor]]) -> None:
        """After the inner step: each held slice back where its flag holds, into the tensor that holds it now (the
        parameter shard, or the optimizer state read again by key: an optimizer may replace a state tensor)."""
        for s, key, lo, hi, saved, keep in held:
            shard = self.shards[s]
            tensor = shard.shard_param.data if key is None else self.optim.state.get(shard.shard_param, {}).get(key)
            if isinstance(tensor, Tensor) and _is_flat_state(tensor, shard):
                view = tensor[lo:hi]
                view.copy_(torch.where(keep, saved, view))

    def _hold_unused(self) -> list[tuple[int, Any, int, int, Tensor, Tensor]]:
        """Before the inner step: for each parameter of this rank's shard that received no gradient on this rank
        since the last step (unused in the forward, a branch not taken, frozen but given to the optimizer), its
        slice of the shard and of every per-element optimizer state, saved, with a flag (a device tensor: no host
        synchronisation) that its reduced gradient slice is all zero -- no rank gave it one. After the step those
        slices are put back where the flag holds: as torch's optimizers skip a parameter whose ``.grad`` is None
        (no weight decay, no moment decay), where the flat shard would have stepped it with a zero gradient. The
        optimizer's step count is per param group (one flat tensor) and still advances."""
        held: list[tuple[int, Any, int, int, Tensor, Tensor]] = []
        for s, shard in enumerate(self.shards):
            used, grad = self._usage.used[s], shard.shard_param.grad
            unused = [(lo, hi) for i, lo, hi in self._spans[s] if not used[i]]
            if not unused or grad is None:
                continue
            tensors: list[tuple[Any, Tensor]] = [(None, shard.shard_param.data)]
            tensors += [(key, value) for key, value in self.optim.state.get(shard.shard_param, {}).items()
                        if _is_flat_state(value, shard)]
            for lo, hi in unused:
                keep = grad[lo:hi].eq(0).all()
                held.extend((s, key, lo, hi, tensor[lo:hi].clone(), keep) for key, tensor in tensors)
        return held

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients. ZeRO-1 always zeroes its flat gradient buffer in place (the ``.grad`` views stay); the
        reduces of an armed backward not yet finished are completed (every rank issued them) and dropped."""
        if self._chunked is not None:
            self._chunked.finish()
        for shard in self.shards:
            shard.zero_grad()
            shard.reduced = None
        self._usage.reset(rehook=True)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the reduced gradient shards by the norm of the *whole* gradient (an all-reduce over ``dp``).

        Padding elements are zero and do not change the norm. Call after :meth:`reduce_gradients`.
        """
        if not self._grads_reduced:
            self.reduce_gradients()
        grads = [s.shard_param.grad for s in self.shards if s.shard_param.grad is not None]
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = torch.stack([g.abs().max() for g in grads]).max()
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
            total = local
        else:
            local = torch.stack([g.pow(norm_type).sum() for g in grads]).sum()
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.group)
            total = local.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return total

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state (a *sharded* state dict: load it on the same number of dp ranks)."""
        return {"format": _SHARDED_FORMAT, "stage": self.stage, "world_size": self.world_size, "rank": self.rank,
                "numels": [s.numel for s in self.shards],
                "shapes": [[list(p.shape) for p in s.params] for s in self.shards], "optim": self.optim.state_dict()}

    def consolidated_state_dict(self) -> dict[str, Any]:
        """The full state in the standard per-parameter form of the user's optimizer (collective: all-gathers).

        Loads into the same optimizer class over the unsharded model on one device, or back into a ZeroOptimizer
        on any number of ranks.
        """
        state: dict[int, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        index = 0
        for pg, shard in zip(self.param_groups, self.shards, strict=True):
            local = self.state.get(shard.shard_param, {})
            per_param: list[dict[str, Any]] = [{} for _ in shard.params]
            for key, value in local.items():
                if _is_flat_state(value, shard):
                    full = torch.empty(shard.padded_numel, dtype=value.dtype, device=value.device)
                    all_gather_into(full, value.contiguous(), group=self.group)
                    for slot, tensor in zip(per_param, shard.unflatten(full), strict=True):
                        slot[key] = tensor
                else:
                    for slot in per_param:
                        slot[key] = value.clone() if isinstance(value, Tensor) else value
            ids = list(range(index, index + len(shard.params)))
            state.update({i: s for i, s in zip(ids, per_param, strict=True) if s})
            groups.append({**{k: v for k, v in pg.items() if k != "params"}, "params": ids})
            index += len(shard.params)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a sharded state dict (same dp size) or a consolidated, per-parameter one (any dp size)."""
        if state_dict.get("format") == _SHARDED_FORMAT:
            if state_dict["world_size"] != self.world_size or state_dict["numels"] != [s.numel for s in self.shards]:
                raise ValueError(
                    f"this sharded ZeRO optimizer state was saved on {state_dict['world_size']} dp ranks with group "
                    f"sizes {state_dict['numels']}; this run has {self.world_size} ranks and "
                    f"{[s.numel for s in self.shards]}. Fix: resume on the same layout, or save a consolidated "
                    "checkpoint (it loads under any layout)."
                )
            self.optim.load_state_dict(state_dict["optim"])
            return
        self.optim.load_state_dict(self._shard_consolidated(state_dict))

    def _shard_consolidated(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(s.params) for s in self.shards]:
            raise ValueError(
                f"the optimizer state has param groups of sizes {[len(g['params']) for g in saved_groups]}, but this "
                f"optimizer's are {[len(s.params) for s in self.shards]}. Fix: build the same param groups."
            )
        saved_state = state_dict["state"]
        state: dict[int, dict[str, Any]] = {}
        groups = []
        for g, (saved, shard) in enumerate(zip(saved_groups, self.shards, strict=True)):
            slots = [saved_state.get(i, saved_state.get(str(i), {})) for i in saved["params"]]
            if slots and slots[0]:
                state[g] = {}
                for key, value in slots[0].items():
                    if isinstance(value, Tensor) and value.numel() == shard.params[0].numel() and value.dim() > 0:
                        full = shard.flatten([s[key].to(shard.flat.device) for s in slots])
                        state[g][key] = shard.shard_of(full).clone()
                    else:
                        state[g][key] = value
            groups.append({**saved, "params": [g]})
        return {"state": state, "param_groups": groups}


class _Usage:
    """Which parameters of ``shards`` received a gradient from autograd since the last step: a post-accumulate-grad
    hook per trainable parameter (torch refuses a hook on a frozen one: it stays unused), made again when the set of
    trainable parameters changed.

    Owned by one :class:`ZeroOptimizer` and changed only in place: Lightning's ``LightningOptimizer`` is an instance
    of a subclass of the wrapped optimizer's class that forwards missing attributes to it, so optimizer methods also
    run with a wrapper as ``self``; an attribute assigned or cleaned up there would belong to the wrapper, which is
    dropped (with its hooks, or taking the optimizer's) while the optimizer lives on. The hooks hold this object
    weakly, so that an optimizer dropped (a second fit of the same module builds another) takes its hooks with it."""

    def __init__(self, shards: list[FlatShard]) -> None:
        self.shards = shards
        self.used = [[False] * len(shard.params) for shard in shards]
        self.trainable: tuple[bool, ...] = ()
        self.handles: list[Any] = []
        self._hook()

    def __del__(self) -> None:
        for handle in getattr(self, "handles", ()):
            handle.remove()

    def _hook(self) -> None:
        self.trainable, self.handles = hook_trainable(self.shards, partial(_mark_used, weakref.ref(self)),
                                                      self.trainable, self.handles)

    def reset(self, *, rehook: bool = False) -> None:
        """Every parameter unused again; ``rehook`` (``zero_grad``, before a step's first backward): hooks for the
        parameters made trainable since (a callback unfreezing a backbone)."""
        for used in self.used:
            used[:] = [False] * len(used)
        if rehook:
            self._hook()


def _mark_used(owner: weakref.ref[_Usage], s: int, i: int, _param: Tensor) -> None:
    usage = owner()
    if usage is not None:
        usage.used[s][i] = True


def _spans_in_shard(shard: FlatShard) -> list[tuple[int, int, int]]:
    """``(parameter index, lo, hi)``: where each parameter of the group lies in this rank's shard (shard-local
    element range; parameters outside the shard are left out)."""
    start, end = shard.shard_range
    spans, offset = [], 0
    for i, n in enumerate(shard.numels):
        lo, hi = max(offset, start), min(offset + n, end)
        if lo < hi:
            spans.append((i, lo - start, hi - start))
        offset += n
    return spans


def _is_flat_state(value: Any, shard: FlatShard) -> bool:
    return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == shard.shard_numel


def _never_stepped(state: dict[str, Any]) -> bool:
    """True for a parameter's optimizer state made at construction (Adagrad's accumulator and a step count of 0), or
    none at all."""
    step = state.get("step", 0)
    return not state or float(step) == 0.0


def _flatten_initial_state(optimizer: Optimizer, params: list[Any], shard: FlatShard) -> None:
    """The state an optimizer made for ``params`` in its constructor (``torch.optim.Adagrad``: ``sum`` filled with
    ``initial_accumulator_value``, ``step`` 0), as the flat shard's: each per-element tensor laid out like the flat
    buffer (padding zero) and this rank's slice kept, each scalar shared by the parameters kept once. Nothing for an
    optimizer that makes its state at its first step (Adam, SGD)."""
    states = [optimizer.state.pop(p, None) or {} for p in params]
    if not any(states):
        return
    flat: dict[str, Any] = {}
    for key in dict.fromkeys(k for state in states for k in state):
        values = [state.get(key) for state in states]
        tensors = [v for v in values if isinstance(v, Tensor)]
        # one value per element: each parameter's shape (a group of 0-dim parameters too, but for its step count)
        if len(tensors) == len(params) and all(v.shape == p.shape for v, p in zip(tensors, params, strict=True)) \
                and (any(v.dim() > 0 for v in tensors) or key != "step"):
            full = torch.zeros(shard.padded_numel, dtype=tensors[0].dtype, device=tensors[0].device)
            for view, value in zip(shard._views(full), tensors, strict=True):  # laid out as the parameters are
                view.copy_(value)
            flat[key] = shard.shard_of(full).clone()
        elif all(isinstance(v, Tensor) and v.dim() == 0 and torch.equal(v, tensors[0]) for v in values) \
                or all(not isinstance(v, Tensor) and v == values[0] for v in values):
            flat[key] = values[0].clone() if isinstance(values[0], Tensor) else values[0]
        else:
            raise ValueError(
                f"{type(optimizer).__name__} made state {key!r} in its constructor that is neither one value per "
                "element of each parameter nor one value shared by them; the flat ZeRO-1/2 shard cannot hold it. Fix: "
                "zero_stage=3 (each parameter keeps its own state) or lp_ddp.")
    optimizer.state[shard.shard_param] = flat

