"""Optimizer state by parameter name for a tensor- or pipeline-parallel module (DTensor or plain parameters): what a
DCP checkpoint stores (:mod:`lightning_parallel.checkpoint.formats.dcp`), independent of the ZeRO stage and of which
rank holds which parameter. No collective, no files, no Lightning import."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

__all__ = ["apply_optimizer_state", "optimizer_state_by_name"]


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}


def optimizer_state_by_name(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``{"state": {fqn: {key: tensor}}, "param_groups": [{..., "params": [fqn, ...]}]}`` for a torch optimizer over
    the module's (DTensor or plain) parameters; state tensors keep their DTensor layout. No collective."""
    name_of = _names(model)
    state: dict[str, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        names = [name_of[id(p)] for p in group["params"]]
        for p, name in zip(group["params"], names, strict=True):
            if optimizer.state.get(p):
                state[name] = dict(optimizer.state[p])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": groups}


def apply_optimizer_state(model: nn.Module, optimizer: Optimizer, by_name: dict[str, Any]) -> None:
    """Put a by-name state (:func:`optimizer_state_by_name`'s form, e.g. read from a DCP checkpoint) into a torch
    optimizer over the module's parameters."""
    name_of = _names(model)
    for group, saved in zip(optimizer.param_groups, by_name["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
        for p in group["params"]:  # this rank's parameters (a pipeline stage holds some of the saved names)
            name = name_of[id(p)]
            if name in by_name["state"]:
                optimizer.state[p] = dict(by_name["state"][name])
