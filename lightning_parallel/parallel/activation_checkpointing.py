"""Activation checkpointing: recompute chosen submodules' forward in backward instead of keeping their activations.

``parallel.activation_checkpointing`` selects what is recomputed (Korthikanti et al. 2022's two schemes):

``none``
    Nothing; every op keeps what its backward needs.
``selective``
    The submodules the module names in ``selective_checkpointing_modules()`` -- for the GPT the attention core of
    each block (``blocks.<i>.attn.core``: the causal softmax of ``q k^T``, its dropout, times ``v``). Their inputs
    q, k, v are kept; the activations that grow with the square of the sequence length (attention probabilities,
    their dropout mask and output) are not, and that core runs once more in backward.
``full``
    The submodules the module names in ``full_checkpointing_modules()``; by default (on
    :class:`~lightning_parallel.ParallelModuleMixin`) every element of ``pipeline_layers()`` that holds parameters,
    and for the GPT each transformer block (``blocks.<i>``; the embedding and the head are not recomputed). Each keeps
    only its input; its whole forward runs again in backward when its gradient is needed (one extra forward of the
    recomputed layers per step).

Recomputation is :func:`torch.utils.checkpoint.checkpoint` with ``use_reentrant=False`` and
``preserve_rng_state=True``: the CPU and device random states are saved at forward and restored for the recompute,
so dropout draws the same mask twice and gradients equal those without checkpointing. It happens only while autograd
records (training forward); under ``torch.no_grad()`` the forward runs as usual.

Parameter names do not change (no wrapper module is inserted, unlike ``checkpoint_wrapper``'s
``_checkpoint_wrapped_module.``): the instance's class is swapped for a subclass whose ``forward`` runs the original
one under the checkpoint, so state dicts, torch DCP checkpoints and tensor-parallel plans keep their keys. Apply it
before wrapping: torch DDP and FSDP2 ``fully_shard`` (which swaps the class again, on top) applied afterwards work
unchanged; so do ``copy.deepcopy``, pickling and ``nn.parallel.replicate``. No Lightning import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_parallel.config import LayoutError
from lightning_parallel.module_hooks import ParallelModuleMixin, require_hook

__all__ = [
    "ACTIVATION_CHECKPOINTING_MODES",
    "activation_checkpointing_targets",
    "apply_activation_checkpointing",
    "checkpointed_modules",
    "remove_activation_checkpointing",
    "saved_activation_bytes",
]

ACTIVATION_CHECKPOINTING_MODES = ("none", "selective", "full")
"""The values of ``parallel.activation_checkpointing``."""


class _Checkpointed(nn.Module):
    """Base of the swapped-in classes: ``forward`` is the original class's, run under a non-reentrant checkpoint."""

    _lp_original_class: type[nn.Module]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # parallel.compile on a recomputed block compiles the original forward; the checkpoint stays around it
        inner = self.__dict__.get("_lp_compiled_forward") or super().forward
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        cls = type(self)
        if _CLASSES.get(cls._lp_original_class) is not cls:  # swapped again on top (e.g. FSDP2): default pickling
            return super().__reduce_ex__(protocol)
        return _restore, (cls._lp_original_class,), self.__getstate__()


_CLASSES: dict[type[nn.Module], type[_Checkpointed]] = {}


def _checkpointed_class(original: type[nn.Module]) -> type[_Checkpointed]:
    cls = _CLASSES.get(original)
    if cls is None:
        cls = type(f"Checkpointed{original.__name__}", (_Checkpointed, original), {"_lp_original_class": original})
        cls.__module__ = original.__module__
        _CLASSES[original] = cls
    return cls


def _restore(original: type[nn.Module]) -> nn.Module:
    """Unpickling / deep copy: an empty instance of the checkpointed subclass (its state is set afterwards)."""
    cls = _checkpointed_class(original)
    return cls.__new__(cls)


def checkpointed_modules(module: nn.Module) -> list[str]:
    """Names of the submodules of ``module`` whose forward is recomputed in backward (``""`` for the module
    itself)."""
    return [name for name, sub in module.named_modules() if isinstance(sub, _Checkpointed)]


def activation_checkpointing_targets(module: nn.Module, mode: str) -> list[str]:
    """The names of the submodules ``mode`` recomputes, without changing anything: ``[]`` for ``none``;
    ``module.selective_checkpointing_modules()`` for ``selective``; ``module.full_checkpointing_modules()``
    (default: the elements of ``module.pipeline_layers()`` that hold parameters) for ``full``.

    Raises :class:`~lightning_parallel.LayoutError` naming the hook to add when the module lacks it, or when a
    returned name is not a submodule; ``ValueError`` for an unknown mode. Strategies can call it before launch.
    """
    if mode not in ACTIVATION_CHECKPOINTING_MODES:
        raise ValueError(f"activation_checkpointing={mode!r}: use one of {', '.join(ACTIVATION_CHECKPOINTING_MODES)}.")
    if mode == "none":
        return []
    setting = f"activation_checkpointing={mode!r}"
    if mode == "selective":
        hook = "selective_checkpointing_modules"
        require_hook(module, hook, strategy=setting)
        names = list(getattr(module, hook)())
    else:
        hook = "full_checkpointing_modules"
        own = getattr(type(module), hook, None)
        if own is not None and own is not ParallelModuleMixin.full_checkpointing_modules:
            names = list(getattr(module, hook)())
        else:  # the default: pipeline_layers() elements with parameters (also for a module without the mixin)
            try:
                require_hook(module, "pipeline_layers", strategy=setting)
            except LayoutError as err:
                raise LayoutError(f"{err} Or implement `{hook}()` (names of the submodules to recompute).") from None
            names = ParallelModuleMixin.full_checkpointing_modules(module)  # type: ignore[arg-type]
    for name in names:
        try:
            sub = module.get_submodule(name) if name else None
        except AttributeError:
            sub = None
        if sub is None:
            raise LayoutError(
                f"{type(module).__name__}.{hook}() names {name!r}, which is not a submodule of it "
                f"(module.get_submodule({name!r}) fails); name submodules by their path, e.g. 'blocks.0'."
            )
    return list(dict.fromkeys(names))


def apply_activation_checkpointing(module: nn.Module, mode: str) -> list[str]:
    """Recompute in backward what ``mode`` (``none``, ``selective`` or ``full``; see the module docstring) names,
    in place, keeping every parameter name; returns the names of the recomputed submodules.

    ``none`` changes nothing and returns ``[]`` (it does not undo an earlier call). Idempotent: applying the same
    mode again changes nothing and returns the same names. A module already checkpointed differently (another mode,
    or other submodules) is refused; call :func:`remove_activation_checkpointing` first. Call it before DDP /
    FSDP2 / tensor-parallel wrapping.
    """
    names = activation_checkpointing_targets(module, mode)
    if not names:
        return []
    done = checkpointed_modules(module)
    if done:
        if done == names:
            return names
        raise ValueError(
            f"{type(module).__name__} already recomputes {done} in backward; activation_checkpointing={mode!r} "
            f"would recompute {names}. Call remove_activation_checkpointing(module) first."
        )
    for name in names:
        sub = module.get_submodule(name)
        sub.__class__ = _checkpointed_class(type(sub))
    return names


def remove_activation_checkpointing(module: nn.Module) -> list[str]:
    """Undo :func:`apply_activation_checkpointing` (before any wrapping); returns the names it restored."""
    names = checkpointed_modules(module)
    for name in names:
        sub = module.get_submodule(name) if name else module
        cls = type(sub)
        original = getattr(cls, "_lp_original_class", None)
        if original is None or _CLASSES.get(original) is not cls:
            raise ValueError(
                f"{name or type(module).__name__} was wrapped after activation checkpointing ({cls.__name__}); "
                "remove the wrapping first."
            )
        sub.__class__ = original
    return names


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's, tensor parallelism's), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def saved_activation_bytes(
    module: nn.Module, forward: Callable[[], Any], *, layers: Mapping[str, nn.Module] | None = None
) -> dict[str, int]:
    """Run ``forward()`` (a forward of ``module`` with autograd recording; keep its result alive for backward
    yourself) and measure the activation memory it leaves for backward: the bytes of the distinct storages autograd
    saves (``torch.autograd.graph.saved_tensors_hooks``), parameters excluded (also the unsharded ones FSDP2 gathers for
    its forward, and a DTensor's local shard), plus the inputs that checkpointed
    submodules hold for their recompute (what autograd saves inside them is dropped, so it is not counted).

    Each storage is counted once and attributed to the entry of ``layers`` (name -> submodule, e.g. the
    ``pipeline_layers()``) whose forward was running when it was first saved, else to ``"other"`` (e.g. the loss);
    ``"total"`` is the sum. Returns ``{"total": ..., **per_layer, "other": ...}``.
    """
    params = {_local(p).untyped_storage().data_ptr() for p in module.parameters()}
    running: dict[int, list[set[int]]] = {}  # id(module) -> its parameters' storages, per call of it still running
    seen: dict[int, tuple[str, int]] = {}
    held: list[torch.Tensor] = []  # keep every counted tensor alive, so that no storage address is reused
    current: list[str] = []

    def record(t: Any) -> None:
        if not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if (ptr in params or ptr in seen or storage.nbytes() == 0
                or any(ptr in own for calls in running.values() for own in calls)):
            return
        seen[ptr] = (current[-1] if current else "other", storage.nbytes())
        held.append(t)

    def pack(t: torch.Tensor) -> torch.Tensor:
        record(t)
        return t

    def enter(name: str) -> Callable[..., None]:
        return lambda *_: current.append(name)

    def leave(*_: Any) -> None:
        current.pop()

    def own_parameters(sub: nn.Module, _: tuple[Any, ...]) -> None:
        # while the module runs: FSDP2 has swapped in the unsharded parameters it gathered (their storages, and the
        # views a linear saves of them, are weights, not activations); once it returns FSDP2 may free them and the
        # allocator hand their addresses to activations
        running.setdefault(id(sub), []).append({_local(p).untyped_storage().data_ptr()
                                                for p in sub.parameters(recurse=False)})

    def own_parameters_done(sub: nn.Module, *_: Any) -> None:
        calls = running.get(id(sub))
        if calls:
            calls.pop()

    def checkpoint_inputs(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.is_grad_enabled():
            for value in (*args, *kwargs.values()):
                record(value)

    handles = []
    try:
        for name, layer in (layers or {}).items():
            handles.append(layer.register_forward_pre_hook(enter(name)))
            handles.append(layer.register_forward_hook(leave, always_call=True))
        for sub in module.modules():
            if any(True for _ in sub.parameters(recurse=False)):
                handles.append(sub.register_forward_pre_hook(own_parameters))
                handles.append(sub.register_forward_hook(own_parameters_done, always_call=True))
            if isinstance(sub, _Checkpointed):
                handles.append(sub.register_forward_pre_hook(checkpoint_inputs, with_kwargs=True))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
    finally:
        for handle in handles:
            handle.remove()
    result = {"total": sum(n for _, n in seen.values())}
    for name in [*(layers or {}), "other"]:
        result[name] = sum(n for owner, n in seen.values() if owner == name)
    return result
