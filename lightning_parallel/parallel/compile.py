"""``torch.compile`` inside the composition, and modules the user compiled themselves. No Lightning import.

``parallel.compile`` compiles each block -- the submodules ``full_checkpointing_modules()`` names (the transformer
blocks; by default every element of ``pipeline_layers()`` that holds parameters) -- *in place*
(``nn.Module.compile``: the module's call goes through ``torch.compile``, its class, names and hooks stay), after the
tensor plan and activation checkpointing and before the data-parallel wrap, torchtitan's order: the compiled graph
sees the DTensor shards and the recomputation, FSDP2 and DDP wrap what is compiled. Per block rather than the whole
model: one graph serves every block of the same shape (compiled once), and a pipeline stage holds whole blocks.
Nothing is communicated by compiling; the collectives of TP, FSDP2 and DDP run as before (inside or between the
compiled graphs).

A module the user compiled (``self.model = torch.compile(self.model)``, an ``OptimizedModule`` holding the module
as ``_orig_mod``) is unwrapped in place by :func:`unwrap_compiled` before anything reads names: the original
module takes its place, compiled in place with the same backend and options, so ``_orig_mod.`` is never part of a
parameter name, a plan key or a checkpoint name (:func:`strip_compile_prefix` for names read from elsewhere).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_parallel.config import LayoutError

__all__ = ["COMPILE_PREFIX", "apply_compile", "check_backend", "compile_backend", "compile_targets",
           "compiled_modules", "copy_local_outputs_into_compiled", "strip_compile_prefix", "unwrap_compiled"]

COMPILE_PREFIX = "_orig_mod."
"""What ``torch.compile``'s ``OptimizedModule`` adds to the names under it."""


def strip_compile_prefix(name: str) -> str:
    """``model._orig_mod.layers.0.weight`` -> ``model.layers.0.weight`` (every occurrence)."""
    return name.replace(COMPILE_PREFIX, "")


def compile_backend(setting: bool | str) -> str | None:
    """The backend ``parallel.compile`` names: None for false, ``"inductor"`` for true, else the string."""
    if setting is False:
        return None
    return "inductor" if setting is True else str(setting)


def check_backend(setting: bool | str) -> None:
    """Refuse (before launch) a backend name torch does not know, listing those it does."""
    backend = compile_backend(setting)
    if backend is None or backend == "inductor":
        return
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise LayoutError(f"parallel.compile={backend!r} is not a torch.compile backend of this torch. Fix: true "
                          f"(inductor) or one of {sorted(known)}.")


def _optimized_module_type() -> type[nn.Module] | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - torch without dynamo
        return None
    return OptimizedModule  # type: ignore[no-any-return]


def unwrap_compiled(module: nn.Module) -> list[str]:
    """Replace every ``OptimizedModule`` inside ``module`` (the user's ``torch.compile(submodule)``) by the module
    it wraps, compiled in place with the same dynamo settings; returns the names of the modules unwrapped (their
    names without ``_orig_mod.``). ``module`` itself cannot be replaced: an ``OptimizedModule`` passed as the whole
    module is refused by the caller."""
    optimized = _optimized_module_type()
    if optimized is None:
        return []
    done: list[str] = []
    while True:
        found = next(((name, sub) for name, sub in module.named_modules() if name and isinstance(sub, optimized)),
                     None)
        if found is None:
            return done
        name, wrapper = found
        inner: nn.Module = wrapper._orig_mod  # type: ignore[assignment]
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        parent._modules[attr] = inner
        context = getattr(wrapper, "dynamo_ctx", None)
        if context is not None and inner._compiled_call_impl is None:
            inner._compiled_call_impl = context(inner._call_impl)  # the user's backend and options
        elif inner._compiled_call_impl is None:
            inner.compile()
        done.append(strip_compile_prefix(name))


def compile_targets(module: nn.Module) -> list[str]:
    """The blocks ``parallel.compile`` compiles: the names of ``full_checkpointing_modules()`` (present on this
    rank). :class:`LayoutError` naming the hook when the module has neither it nor ``pipeline_layers()``."""
    from lightning_parallel.parallel.activation_checkpointing import activation_checkpointing_targets

    try:
        return activation_checkpointing_targets(module, "full")
    except LayoutError as err:
        raise LayoutError(
            f"parallel.compile compiles each block of the model, which {type(module).__name__} does not name: {err} "
            "Or leave parallel.compile off and compile yourself (self.model = torch.compile(self.model)): the "
            "library unwraps it so names stay the same."
        ) from None


def apply_compile(module: nn.Module, setting: bool | str, **options: Any) -> list[str]:
    """Compile each block of ``module`` in place; returns their names.

    A block is compiled with ``nn.Module.compile(backend=...)`` (its call, hooks included, as ``torch.compile(block)``
    would). A block that activation checkpointing recomputes gets its original ``forward`` compiled instead, inside
    the checkpoint: the recomputation stays an eager ``torch.utils.checkpoint`` around the compiled graph, which
    runs twice (forward, and again in backward), so a block whose forward has side effects (Hugging Face layers
    record outputs in a context variable) still compiles -- traced inside the checkpoint it would not.
    """
    import torch

    backend = compile_backend(setting)
    if backend is None:
        return []
    names = compile_targets(module)
    for name in names:
        block = module.get_submodule(name)
        original = getattr(type(block), "_lp_original_class", None)
        if original is not None:  # recomputed in backward (activation_checkpointing)
            block.__dict__["_lp_compiled_forward"] = torch.compile(original.forward.__get__(block), backend=backend,
                                                                   **options)
        else:
            block.compile(backend=backend, **options)
    return names


def copy_local_outputs_into_compiled(module: nn.Module, tensor_plan: dict[str, Any], compiled: list[str]) -> list[str]:
    """Tensor-parallel modules outside the compiled blocks whose output is a plain tensor made by ``to_local()``
    (a vocab-parallel embedding, a row linear) hand a copy on: a compiled block that reads the ``to_local()`` view
    directly fails in backward (torch 2.13, AOTAutograd: "'Tensor' object has no attribute '_local_tensor'"). One
    copy of the activation per step; returns the names hooked."""
    from torch import Tensor
    from torch.distributed.tensor import DTensor

    def copy(_mod: nn.Module, _args: Any, output: Any) -> Any:
        if isinstance(output, Tensor) and not isinstance(output, DTensor) and output._is_view():
            return output.clone()
        return output

    inside = tuple(f"{c}." for c in compiled)
    hooked = []
    for name, style in tensor_plan.items():
        if name in compiled or name.startswith(inside) or style not in ("vocab", "row", "sequence_scatter"):
            continue
        module.get_submodule(name).register_forward_hook(copy)
        hooked.append(name)
    return hooked


def compiled_modules(module: nn.Module) -> list[str]:
    """Names of the submodules whose call or (recomputed) forward goes through ``torch.compile``."""
    return [name for name, sub in module.named_modules()
            if getattr(sub, "_compiled_call_impl", None) is not None or "_lp_compiled_forward" in sub.__dict__]

