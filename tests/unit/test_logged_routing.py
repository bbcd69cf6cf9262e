"""Which logged values a training step's ``self.log`` routes to the combination over dp (``GlobalBatchLogs``): every
floating-point tensor logged without ``sync_dist``/``rank_zero_only``/``enable_graph``, by its ``reduce_fx``, whether
the options are given by keyword (the usual call, read without binding the signature) or by position. No process
group: the combination is a recording stand-in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_parallel.strategies.logged import global_batch_logs


class Module:
    def __init__(self) -> None:
        self.logged: list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]] = []

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        self.logged.append((name, value, args, kwargs))


def test_keyword_and_positional_options_route_alike() -> None:
    module = Module()
    seen: list[tuple[float, Any]] = []

    def reduce(values: Sequence[tuple[Tensor, Any]], extra: Tensor | None) -> tuple[list[Tensor], Tensor | None]:
        seen.extend((float(v), fx) for v, fx in values)
        return [v * 10 for v, _ in values], None if extra is None else extra * 2

    with global_batch_logs(module, reduce) as logs:
        module.log("a", torch.tensor(1.0))  # mean by default
        module.log("b", torch.tensor(2.0), reduce_fx="sum", prog_bar=True)
        module.log("c", torch.tensor(3.0), False, None, None, None, "max")  # reduce_fx by position
        module.log("d", torch.tensor(4.0), sync_dist=True)  # Lightning reduces it: left alone
        module.log("e", torch.tensor(5.0), False, None, None, None, "mean", False, True)  # sync_dist by position
        module.log("f", torch.tensor(6.0), rank_zero_only=True)
        module.log("g", 7)  # not a tensor
        module.log("h", torch.tensor(8), reduce_fx="sum")  # an integer tensor
        summed = logs.finish(torch.tensor([1.0]))
    assert seen == [(1.0, "mean"), (2.0, "sum"), (3.0, "max")]
    values = {name: (float(value) if isinstance(value, Tensor) else value) for name, value, _, _ in module.logged}
    assert values == {"a": 10.0, "b": 20.0, "c": 30.0, "d": 4.0, "e": 5.0, "f": 6.0, "g": 7, "h": 8.0}
    assert [name for name, *_ in module.logged] == list("abcdefgh")  # in their order, with their own options
    assert module.logged[1][3] == {"reduce_fx": "sum", "prog_bar": True}
    assert module.logged[2][2] == (False, None, None, None, "max")
    assert summed is not None and summed.tolist() == [2.0]
    assert "log" not in vars(module)  # the class's log is back
