"""A module's context-parallel plan: which attention calls run over ``cp`` and which batch tensors are split.

A module opts in with :meth:`~lightning_parallel.module_hooks.ParallelModuleMixin.context_parallel_plan`, returning::

    {"attention": ["blocks.*.attn.core"],   # submodules whose forward(q, k, v) is causal attention
     "batch": {0: 1, 1: 1},                 # batch[0] and batch[1] are split along dim 1 (the sequence)
     "labels": 1}                           # optional: batch[1] holds the token labels (-100: not counted)

* ``attention`` -- names or ``*`` patterns (one dotted component) of parameter-free submodules whose
  ``forward(q, k, v)`` computes exactly ``softmax(q k^T / sqrt(head_dim) + causal mask) v`` on
  ``(batch, heads, seq, head_dim)`` tensors (a ``scale`` attribute, if the submodule has one, replaces
  ``1 / sqrt(head_dim)``). Under cp their class is swapped (names unchanged, as activation checkpointing does) for
  one whose forward runs :func:`~.ring.ring_attention` or :func:`~.ulysses.all_to_all_attention` over the cp group
  instead of the module's own; outside an active cp composition they run their own forward.
* ``batch`` -- where the sequence is in the batch: ``{index or key: dim}`` for a tuple/list or dict batch, or one
  ``int`` for every tensor of the batch. Those tensors are cut to this rank's head and tail chunks
  (:func:`~.sharding.shard_sequence`) before the module's step sees them; other entries pass whole.
* ``labels`` (optional) -- the batch entry (index or key, one the ``batch`` entry splits) holding the token labels
  of a loss that is the mean over the counted tokens (labels other than ``ignore_index``, default ``-100``, as
  ``F.cross_entropy`` counts them). Each cp rank's loss is a mean over its own counted tokens, and padding or
  masked prompts put the ignored labels unevenly over the chunks (padding at the end of every sample falls in the
  tail chunks only); the mean of the ranks' means then weighs tokens unlike one device. With ``labels`` each rank's
  loss (and every value logged with a mean) is scaled by its share of the counted tokens,
  :func:`token_share` ``= cp x n_rank / n_sequence``, so the mean over the cp ranks is the mean over every counted
  token of the micro-batch -- the module's loss on the whole sequence. The counts are read from the whole batch
  before it is split (no collective). The same ``labels`` weigh the data-parallel ranks' losses, a pipeline's
  micro-batches and a step's accumulated batches by their counted tokens too, at any cp (:func:`loss_labels`,
  :func:`counted_tokens`; the strategies sum the counts over ``dp``, the training loader reads each accumulation
  window ahead), so every counted token of an optimizer step weighs the same. Where the loss counts labels that no
  batch entry holds as such (Hugging Face's causal LMs shift ``labels``, or ``input_ids`` without them, inside their
  loss), ``labels`` may instead be a function ``batch -> labels as the loss counts them``: it weighs dp ranks,
  micro-batches and accumulated batches the same way, but cannot be cut along the sequence, so it is refused at
  cp > 1.

Positions: a module with position embeddings calls :func:`~.sharding.sequence_positions` (the GPT's embedding does),
which returns this rank's global positions under cp and ``arange`` otherwise.

Refused before any process starts (:func:`check_context_plan`), with the reason: a module without the hook (the
error shows a minimal implementation), a name that matches nothing, an attention submodule with parameters (its
forward is replaced, its parameters would get no gradient), with attention dropout (the one-device dropout mask over
the ``s x s`` probabilities cannot be drawn block by block: set it to 0), or with ``is_causal = False`` (a mask other
than causal: the head-tail split and the ring's skipped blocks assume causality). At run time a routed call with an
``attn_mask`` or ``is_causal=False`` raises for the same reason. No Lightning import.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_parallel.config import LayoutError

from .ring import ring_attention
from .sharding import ContextParallelState, SequenceShard, activate, active, shard_sequence
from .ulysses import all_to_all_attention

__all__ = ["MINIMAL_PLAN", "ContextParallelPlan", "apply_context_parallel", "batch_token_share", "check_context_plan",
           "context_parallel_modules", "counted_tokens", "describe_labels", "labels_of", "loss_labels", "read_plan",
           "split_batch", "split_length", "token_share", "unrouted_attention_check", "unsplit_sequences",
           "weigh"]

MINIMAL_PLAN = (
    "def context_parallel_plan(self):\n"
    "    # attention cores: forward(q, k, v) -> causal softmax(q k^T / sqrt(d)) v on (batch, heads, seq, head_dim)\n"
    "    return {\"attention\": [\"layers.*.attn_core\"], \"batch\": {0: 1, 1: 1},  # (tokens, labels): seq dim 1\n"
    "            \"labels\": 1}  # batch[1]: the labels of a token-mean loss (-100 not counted)\n"
    "# and positions from lightning_parallel.parallel.context_parallel.sequence_positions(t, device)"
)
"""What a refusal of a module without the hook shows."""


@dataclass(frozen=True)
class ContextParallelPlan:
    """A module's plan, expanded: the attention submodules' names (module order), the batch's sequence dims, and
    the batch entry holding the token labels, or a function of the batch returning them (None: the loss is not
    reweighted), with the label that is not counted."""

    attention: tuple[str, ...]
    batch: int | Mapping[Any, int] = field(default_factory=dict)
    labels: Any = None
    ignore_index: int = -100
    unsplit_attention: tuple[str, ...] = ()
    """Names or patterns of submodules whose ``scaled_dot_product_attention`` attends onto something the plan does not
    split (a cross-attention onto a learned memory): left as they are, and not refused by the attention check."""

    def sequence_dim(self, key: Any) -> int | None:
        """The sequence dim of batch entry ``key``, None when the plan does not split it."""
        if isinstance(self.batch, int):
            return self.batch
        return self.batch.get(key) if isinstance(self.batch, Mapping) else None


_KEYS = {"attention", "batch", "labels", "ignore_index", "unsplit_attention"}


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("^" + r"[^.]+".join(re.escape(part) for part in key.split("*")) + "$")


def _refuse(module: nn.Module, why: str) -> LayoutError:
    return LayoutError(f"{type(module).__name__}.context_parallel_plan(): {why}")


def read_plan(module: nn.Module, *, skip_missing: bool = False) -> ContextParallelPlan:
    """The module's ``context_parallel_plan()`` checked and expanded (:class:`LayoutError` naming what is wrong);
    ``skip_missing``: a pattern may match nothing (a pipeline stage without those layers)."""
    from lightning_parallel.module_hooks import require_hook

    try:
        require_hook(module, "context_parallel_plan", strategy="parallel.context_parallel_size > 1")
    except LayoutError as err:
        raise LayoutError(f"{err} A minimal implementation:\n{MINIMAL_PLAN}") from None
    raw = module.context_parallel_plan()  # type: ignore[operator]
    if not isinstance(raw, Mapping) or set(raw) - _KEYS or "attention" not in raw:
        shown = {k: describe_labels(v) if callable(v) else v for k, v in raw.items()} if isinstance(
            raw, Mapping) else raw  # (a bound method's repr would print the whole module)
        raise _refuse(module, f"returned {shown!r}; it must return a dict with the keys 'attention' (names of the "
                              f"attention submodules) and 'batch' (the sequence dim of the batch tensors), and "
                              f"optionally 'labels' (the batch entry of the token labels, or a function of the batch "
                              f"returning them), 'ignore_index' and 'unsplit_attention' (submodules attending onto "
                              f"what the plan does not split, e.g. a cross-attention onto a learned memory). "
                              f"Example:\n{MINIMAL_PLAN}")
    keys = raw["attention"]
    if isinstance(keys, str) or not all(isinstance(k, str) for k in keys) or not keys:
        raise _refuse(module, f"'attention' must be a non-empty list of submodule names or patterns, got {keys!r}.")
    names = [n for n, _ in module.named_modules() if n]
    found: list[str] = []
    for key in keys:
        matched = [n for n in names if _pattern(key).match(n)] if "*" in key else [key] if key in names else []
        if not matched and not skip_missing:
            raise _refuse(module, f"'attention' entry {key!r} matches no submodule. Fix: names from "
                                  "module.named_modules() ('*' matches one dotted component, e.g. "
                                  "'blocks.*.attn.core').")
        found.extend(n for n in matched if n not in found)
    batch = raw.get("batch", {})
    dims = [batch] if isinstance(batch, int) else list(batch.values()) if isinstance(batch, Mapping) else [None]
    if isinstance(batch, bool) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise _refuse(module, f"'batch' must be the sequence dim of every batch tensor (an int) or a mapping "
                              f"{{batch index or key: sequence dim}}, got {batch!r}.")
    order = {n: i for i, n in enumerate(names)}
    unsplit = raw.get("unsplit_attention", ())
    if isinstance(unsplit, str) or not all(isinstance(k, str) for k in unsplit):
        raise _refuse(module, f"'unsplit_attention' must be a list of submodule names or patterns, got {unsplit!r}.")
    plan = ContextParallelPlan(attention=tuple(sorted(found, key=order.__getitem__)), batch=batch,
                               labels=raw.get("labels"), ignore_index=raw.get("ignore_index", -100),
                               unsplit_attention=tuple(unsplit))
    if callable(plan.labels):
        raise _refuse(module, f"'labels' is a function ({describe_labels(plan.labels)}): it can weigh data-parallel "
                              "ranks, micro-batches and accumulated batches by their counted tokens, but context "
                              "parallelism cuts the labels with the tokens along the sequence, so it needs the batch "
                              "entry. Fix: name the entry of the labels (index or key, split by 'batch'), or "
                              "context_parallel_size=1.")
    if plan.labels is not None and plan.sequence_dim(plan.labels) is None:
        raise _refuse(module, f"'labels' names batch entry {plan.labels!r}, which 'batch' ({batch!r}) does not "
                              "split: the labels are cut with the tokens. Fix: add it to 'batch' with its sequence "
                              "dim, or name the entry that holds the token labels.")
    if "ignore_index" in raw and (plan.labels is None or isinstance(plan.ignore_index, bool)
                                  or not isinstance(plan.ignore_index, int)):
        raise _refuse(module, f"'ignore_index' must be an int (the label a token mean does not count, -100 for "
                              f"F.cross_entropy) given with 'labels', got {raw['ignore_index']!r} with "
                              f"'labels'={plan.labels!r}.")
    return plan


def check_context_plan(module: nn.Module) -> ContextParallelPlan:
    """Before spawning: the plan reads (:func:`read_plan`) and every attention submodule can be routed: no
    parameters, no attention dropout, causal. Returns the plan."""
    plan = read_plan(module)
    for name in plan.attention:
        sub = module.get_submodule(name)
        params = [n for n, _ in sub.named_parameters()]
        if params:
            raise _refuse(module, f"attention submodule {name!r} has parameters {params[:3]}: under context "
                                  "parallelism its forward is replaced by ring attention, so they would get no "
                                  "gradient. Fix: name the parameter-free attention core (softmax(q k^T) v), not the "
                                  "layer with the projections.")
        for attr in ("dropout", "dropout_p", "attn_dropout"):
            p = getattr(sub, attr, 0.0)
            if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
                raise _refuse(module, f"attention submodule {name!r} has {attr}={p}: dropout on the attention "
                                      "probabilities is not run under context parallelism (the one-device mask over "
                                      "the s x s probabilities cannot be drawn block by block across ranks). Fix: "
                                      f"{attr}=0 on the attention (dropout elsewhere is unaffected), or "
                                      "context_parallel_size=1.")
        if getattr(sub, "is_causal", True) is False:
            raise _refuse(module, f"attention submodule {name!r} is not causal (is_causal=False): context "
                                  "parallelism here runs causal attention only -- the head-tail split balances the "
                                  "causal mask and the ring skips the blocks it masks; a full or arbitrary mask "
                                  "would need every block and a mask split the same way. Fix: causal attention, or "
                                  "context_parallel_size=1.")
    return plan


class _Routed(nn.Module):
    """Base of the swapped-in classes: ``forward(q, k, v)`` runs over the cp group while a cp state is active."""

    _lp_original_class: type[nn.Module]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        state = active()
        if state is None or state.shard.cp == 1:
            return super().forward(q, k, v, *args, **kwargs)  # type: ignore[no-any-return]
        mask = kwargs.get("attn_mask", args[0] if args else None)
        if mask is not None or kwargs.get("is_causal", True) is False:
            raise ValueError(
                f"{type(self).__name__} was called with attn_mask={type(mask).__name__}, "
                f"is_causal={kwargs.get('is_causal', True)} under context parallelism, which runs causal attention "
                "only: each rank holds a head and a tail chunk of the sequence and the ring skips the blocks the "
                "causal mask hides. Fix: causal attention without a mask, or context_parallel_size=1.")
        scale = getattr(self, "scale", None)
        _ROUTED_DEPTH[0] += 1
        try:
            if state.style == "all_to_all":
                return all_to_all_attention(q, k, v, group=state.group, scale=scale)
            return ring_attention(q, k, v, group=state.group, scale=scale)
        finally:
            _ROUTED_DEPTH[0] -= 1


_ROUTED_DEPTH = [0]
"""How many routed attentions are running (their own kernels call ``scaled_dot_product_attention``)."""


class _UnroutedAttention(TorchFunctionMode):
    """While active: ``F.scaled_dot_product_attention`` called outside a routed submodule on queries and keys of one
    length (a self-attention over the rank's tokens) is refused -- under context parallelism it would attend over
    this rank's head and tail chunks only (another model than one device's, silently: a plan naming one block's
    attention of two trained 1.2e-02 from one device in 3 steps). Submodules the plan names in
    ``unsplit_attention`` (a cross-attention onto a memory it does not split) are left alone."""

    def __init__(self, root: nn.Module, unsplit: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.root = root
        self.unsplit = [_pattern(key) for key in unsplit]

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.nn.functional.scaled_dot_product_attention and _ROUTED_DEPTH[0] == 0:
            kwargs = kwargs or {}
            q, k = (list(args) + [kwargs.get("query"), kwargs.get("key")][len(args):])[:2]
            if isinstance(q, Tensor) and isinstance(k, Tensor) and q.shape[-2] == k.shape[-2]:
                where = self._caller()  # a self-attention over the rank's tokens, unless the plan says otherwise
                if not (where and any(p.match(where) for p in self.unsplit)):
                    raise LayoutError(self._message(where))
        return func(*args, **(kwargs or {}))

    def _caller(self) -> str | None:
        """The name of the innermost submodule of the root whose frame is on the stack (the caller), or None."""
        import sys

        names = {id(m): name for name, m in self.root.named_modules()}
        frame: Any = sys._getframe(2)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in names:
                return names[id(owner)] or type(owner).__name__
            frame = frame.f_back
        return None

    def _message(self, where: str | None) -> str:
        routed = context_parallel_modules(self.root)
        return (f"context parallelism: {'submodule ' + repr(where) if where else 'the model'} calls "
                "scaled_dot_product_attention outside the attention submodules context_parallel_plan()['attention'] "
                f"names ({', '.join(routed[:4])}{' ...' if len(routed) > 4 else ''}): on a rank's head and tail chunks "
                "of the sequence it would attend over those chunks only -- another model than one device's. Fix: "
                "name every attention submodule in context_parallel_plan()['attention'] (a pattern such as "
                "'blocks.*.attn.core' names all), or context_parallel_size=1; a cross-attention onto a memory the "
                "plan does not split goes in context_parallel_plan()['unsplit_attention'].")


def unrouted_attention_check(module: nn.Module, plan: ContextParallelPlan | None = None) -> Any:
    """A context (:class:`_UnroutedAttention`) that refuses an attention kernel called outside the routed submodules
    of ``module`` (and those ``plan`` names as ``unsplit_attention``) while it is open: the strategies open it around
    the first step of a run under cp > 1."""
    return _UnroutedAttention(module, plan.unsplit_attention if plan is not None else ())


_CLASSES: dict[type[nn.Module], type[_Routed]] = {}


def _routed_class(original: type[nn.Module]) -> type[_Routed]:
    cls = _CLASSES.get(original)
    if cls is None:
        cls = type(f"ContextParallel{original.__name__}", (_Routed, original), {"_lp_original_class": original})
        cls.__module__ = original.__module__
        _CLASSES[original] = cls
    return cls


def context_parallel_modules(module: nn.Module) -> list[str]:
    """Names of the submodules routed to context-parallel attention."""
    return [name for name, sub in module.named_modules() if isinstance(sub, _Routed)]


def apply_context_parallel(module: nn.Module, *, group: Any, shard: SequenceShard, style: str = "ring",
                           skip_missing: bool = False) -> ContextParallelPlan:
    """Route the plan's attention submodules of ``module`` (in place, names unchanged) and make ``(group, shard,
    style)`` the process's cp state (:func:`~.sharding.activate`). Returns the plan."""
    plan = read_plan(module, skip_missing=skip_missing)
    for name in plan.attention:
        sub = module.get_submodule(name)
        if not isinstance(sub, _Routed):
            sub.__class__ = _routed_class(type(sub))
    activate(ContextParallelState(group=group, shard=shard, style=style))
    return plan


def split_batch(batch: Any, plan: ContextParallelPlan, shard: SequenceShard, *, complete: bool = True) -> Any:
    """This rank's part of ``batch``: the tensors the plan names cut to its head and tail chunks along their sequence
    dim (a tuple/list/dict of the same type; a lone tensor with an int plan); the rest unchanged. ``complete``
    (a training batch): every entry the plan names must be there; otherwise (an evaluation or prediction batch,
    which may come without its labels) a named entry it lacks is left out."""
    spec = plan.batch
    if isinstance(batch, Tensor):  # a lone tensor: an int plan, or the plan's entry 0 (the input of a tuple batch)
        dim = spec if isinstance(spec, int) else spec.get(0) if isinstance(spec, Mapping) else None
        if not isinstance(dim, int):
            raise ValueError(f"the batch is one tensor, so context_parallel_plan()['batch'] must be its sequence dim "
                             f"(an int) or name entry 0, got {spec!r}.")
        return shard_sequence(batch, dim, shard)
    if isinstance(batch, Mapping):
        out = dict(batch)
        keys = list(batch) if isinstance(spec, int) else list(spec)
        for key in keys:
            if key not in batch and not complete:
                continue
            if key not in batch:
                raise KeyError(f"context_parallel_plan()['batch'] names {key!r}, which the batch (keys "
                               f"{list(batch)}) does not have.")
            if isinstance(batch[key], Tensor):
                out[key] = shard_sequence(_has_dim(batch[key], spec if isinstance(spec, int) else spec[key], key),
                                          spec if isinstance(spec, int) else spec[key], shard)
        return type(batch)(out) if type(batch) is not dict else out  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        items = list(batch)
        indices = range(len(items)) if isinstance(spec, int) else list(spec)
        for i in indices:
            if isinstance(i, int) and not -len(items) <= i < len(items) and not complete:
                continue
            if not isinstance(i, int) or not -len(items) <= i < len(items):
                raise KeyError(f"context_parallel_plan()['batch'] names {i!r}, but the batch is a "
                               f"{type(batch).__name__} of {len(items)}.")
            if isinstance(items[i], Tensor):
                items[i] = shard_sequence(_has_dim(items[i], spec if isinstance(spec, int) else spec[i], i),
                                          spec if isinstance(spec, int) else spec[i], shard)
        if isinstance(batch, list):
            return type(batch)(items)
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)  # a namedtuple keeps its type
    raise TypeError(f"context parallelism cannot split a {type(batch).__name__} batch. Fix: batches of tensors in a "
                    "tuple, list or dict, with context_parallel_plan()['batch'] naming their sequence dims.")


def _has_dim(tensor: Tensor, dim: int, key: Any) -> Tensor:
    if tensor.dim() > dim:
        return tensor
    raise ValueError(
        f"context_parallel_plan()['batch'] splits batch entry {key!r} along dim {dim}, but it is a tensor of shape "
        f"{tuple(tensor.shape)} (one value per sample, not per token?). Fix: name only the per-token entries with "
        "their sequence dims, e.g. {'batch': {0: 1, 1: 1}} for (tokens, labels, per-sample weights).")


def unsplit_sequences(batch: Any, plan: ContextParallelPlan) -> list[str]:
    """The tensor entries of ``batch`` the plan does not split that have the sequence's length along its sequence dim
    (a loss mask, per-token weights): each cp rank would get them whole while the tokens are cut. Named for a
    warning: a per-sample tensor can have that length by chance."""
    length = split_length(batch, plan)
    spec = plan.batch
    if length is None or isinstance(spec, int) or isinstance(batch, Tensor):
        return []
    dim = next(iter(spec.values()), 1)
    entries = batch.items() if isinstance(batch, Mapping) else enumerate(batch) if isinstance(
        batch, (list, tuple)) else []
    named = set(spec) if isinstance(batch, Mapping) else {k % len(batch) for k in spec if isinstance(k, int)}
    return [f"{key!r} of shape {tuple(value.shape)}" for key, value in entries
            if key not in named and isinstance(value, Tensor) and value.dim() > dim and value.shape[dim] == length]


def split_length(batch: Any, plan: ContextParallelPlan) -> int | None:
    """The sequence length of ``batch`` (this rank's part, or the whole) along the first entry the plan splits that
    the batch holds as a tensor; None when it holds none."""
    spec = plan.batch
    if isinstance(batch, Tensor):
        dim = spec if isinstance(spec, int) else spec.get(0) if isinstance(spec, Mapping) else None
        return int(batch.shape[dim]) if isinstance(dim, int) and batch.dim() > dim else None
    keys: Any = list(spec) if isinstance(spec, Mapping) else (
        list(batch) if isinstance(batch, Mapping) else range(len(batch)) if isinstance(batch, (list, tuple)) else [])
    for key in keys:
        value = _entry(batch, key)
        dim = spec if isinstance(spec, int) else spec[key]
        if isinstance(value, Tensor) and value.dim() > dim:
            return int(value.shape[dim])
    return None


def _entry(batch: Any, key: Any) -> Any:
    if isinstance(batch, Tensor):
        return batch if key == 0 else None
    if isinstance(batch, Mapping):
        return batch.get(key)
    if isinstance(batch, (list, tuple)) and isinstance(key, int) and -len(batch) <= key < len(batch):
        return batch[key]
    return None


def describe_labels(labels: Any) -> str:
    """How a refusal names the plan's ``labels``: the entry's repr, or the function's qualified name."""
    if callable(labels):
        return getattr(labels, "__qualname__", None) or type(labels).__name__
    return repr(labels)


def labels_of(batch: Any, plan: ContextParallelPlan) -> Tensor:
    """The token labels the plan names in ``batch`` -- the entry, or what the plan's function returns for it
    (ValueError naming the entry or function when that is no integer tensor)."""
    if callable(plan.labels):
        try:
            labels = plan.labels(batch)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"context_parallel_plan()['labels'], the function {describe_labels(plan.labels)}, "
                             f"raised {type(err).__name__}: {err} on a batch ({type(batch).__name__}). Fix: return "
                             "the labels the loss counts for every training batch, or leave 'labels' out (the loss "
                             "is then not reweighted by each rank's counted tokens).") from err
        where = f"the function {describe_labels(plan.labels)} returns"
    else:
        labels = _entry(batch, plan.labels)
        where = f"names batch entry {plan.labels!r}, which holds"
    if not isinstance(labels, Tensor) or labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"context_parallel_plan()['labels'] {where} "
                         f"{type(labels).__name__ if not isinstance(labels, Tensor) else labels.dtype}, not integer "
                         "token labels. Fix: name the entry of the labels, or leave 'labels' out (the loss is then "
                         "not reweighted by each rank's counted tokens).")
    return labels


def token_share(mine: Tensor, total: Tensor, pieces: int) -> Tensor:
    """``pieces x mine / total`` (float): the weight of one of ``pieces`` token-mean losses averaged together (cp
    ranks' chunks, dp ranks' batches, a pipeline's micro-batches) when it counts ``mine`` of their ``total`` counted
    tokens; the weights add up to ``pieces``, so the mean of ``weight x (mean over the piece's tokens)`` is the mean
    over every counted token. 1 when nothing is counted (every loss is then what one device's is, NaN for a token
    mean). No host synchronisation."""
    return torch.where(total > 0, mine * pieces / total.clamp(min=1), 1.0)  # int / int: a float tensor


def weigh(value: Tensor, weight: Tensor) -> Tensor:
    """``value x weight``, and 0 where the weight is 0: a rank that counts no token contributes nothing, although
    its token mean (0 / 0) is NaN -- its gradient is still computed (zero), so collectives in backward still run."""
    return torch.where(weight > 0, value * weight, 0.0)


def loss_labels(module: nn.Module) -> ContextParallelPlan | None:
    """The token labels the module's ``context_parallel_plan()`` names (``labels``, ``ignore_index``), read at any cp
    without checking the rest of the plan (a module run without cp need not route its attention): the plan's other
    keys are kept as given. None when the module has no such hook, the hook raises ``NotImplementedError`` (the
    mixin's default), or the plan names no labels."""
    hook = getattr(module, "context_parallel_plan", None)
    if not callable(hook):
        return None
    try:
        raw = hook()
    except NotImplementedError:
        return None
    if not isinstance(raw, Mapping) or raw.get("labels") is None:
        return None
    ignore = raw.get("ignore_index", -100)
    if isinstance(ignore, bool) or not isinstance(ignore, int):
        raise _refuse(module, f"'ignore_index' must be an int (the label a token mean does not count, -100 for "
                              f"F.cross_entropy), got {ignore!r}.")
    return ContextParallelPlan(attention=(), batch=raw.get("batch", {}), labels=raw["labels"], ignore_index=ignore)


def counted_tokens(batch: Any, plan: ContextParallelPlan) -> Tensor:
    """How many labels of ``batch`` (the plan's :func:`labels_of`) a token-mean loss counts (those other than the
    plan's ``ignore_index``): an integer tensor on the labels' device, no host synchronisation."""
    return (labels_of(batch, plan) != plan.ignore_index).sum()


def batch_token_share(batch: Any, plan: ContextParallelPlan, shard: SequenceShard) -> Tensor | None:
    """This rank's :func:`token_share` of ``batch`` (the whole batch, before :func:`split_batch`): the labels' counted
    tokens in its head and tail chunks over those of the whole sequence, summed over the batch. None when the plan
    names no labels. No collective: every cp rank holds the whole batch."""
    if plan.labels is None:
        return None
    labels = labels_of(batch, plan)
    dim = plan.sequence_dim(plan.labels)
    assert dim is not None
    counted = labels != plan.ignore_index
    c = shard.check_length(labels.shape[dim], what=f"the labels of shape {tuple(labels.shape)} along dim {dim}")
    head, tail = shard.chunks  # views, no copy: the rank's two chunks counted where they lie
    mine = counted.narrow(dim, head * c, c).sum() + counted.narrow(dim, tail * c, c).sum()
    return token_share(mine, counted.sum(), shard.cp)
