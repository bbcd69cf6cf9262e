"""The logged values of a training step are combined over dp in as few all-reduces as their reductions allow, with the
non-finite-loss guard's numbers riding in the first (``reduce_logged_batch``): the values equal the one-device
reduction of every rank's value -- also over a world where model-parallel peers hold each replica's values alike --
and the number of collectives is counted."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.parallel.step import reduce_logged_batch
from lightning_parallel.testing import run_distributed


def _batched(rank: int, world: int) -> dict[str, Any]:
    calls: list[int] = []
    original = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # no __wrapped__: unwrap keeps it
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        r = float(rank + 1)
        values = [(torch.tensor(r), "mean"), (torch.tensor(10 * r), "sum"), (torch.tensor(r), "max"),
                  (torch.tensor(-r), torch.min), (torch.tensor(r, dtype=torch.float64), "mean"),
                  (torch.tensor(7.0 * r), lambda x: x), (torch.tensor([r, 2 * r]), "mean")]
        extra = torch.tensor([r, 1.0])
        out, summed = reduce_logged_batch(values, group=None, size=world, extra=extra)
        one, _ = reduce_logged_batch([(torch.tensor(r), "mean")], group=None, size=world)
        alone, summed_alone = reduce_logged_batch([], group=None, size=world, extra=torch.tensor([r]))
        single, same = reduce_logged_batch([(torch.tensor(r), "mean")], group=None, size=1, extra=extra)
        # model-parallel peers: ranks 2k and 2k+1 hold replica k's values alike (world/2 replicas, 2 copies each)
        v = float(rank // 2 + 1)
        peers, peers_extra = reduce_logged_batch([(torch.tensor(v), "mean"), (torch.tensor(10 * v), "sum"),
                                                  (torch.tensor(v), "max")], group=None, size=world // 2, copies=2,
                                                 extra=torch.tensor([r]))
        tp_only, tp_extra = reduce_logged_batch([(torch.tensor(3.0), "mean")], group=None, size=1, copies=world,
                                                extra=torch.tensor([r]))
    finally:
        dist.all_reduce = original  # type: ignore[assignment]
    return {"out": [o.tolist() for o in out], "dtypes": [str(o.dtype) for o in out], "summed": summed.tolist(),
            "calls": calls, "one": one[0].item(), "alone": (alone, summed_alone.tolist()),
            "single": (single[0].item(), same is extra),
            "peers": ([o.item() for o in peers], peers_extra.tolist()),
            "tp_only": (tp_only[0].item(), tp_extra.tolist())}


def test_logged_values_are_combined_in_one_all_reduce_per_kind_with_the_guard_riding() -> None:
    world = 4
    results = run_distributed(_batched, world)
    ranks = [float(r + 1) for r in range(world)]
    for got in results:
        mean, total = sum(ranks) / world, sum(ranks)
        assert got["out"][0] == mean and got["out"][1] == 10 * total
        assert got["out"][2] == max(ranks) and got["out"][3] == -max(ranks)
        assert got["out"][4] == mean and got["dtypes"][4] == "torch.float64"
        assert got["out"][5] == 7.0 * (ranks[results.index(got)])  # a custom reduce_fx: this rank's own value
        assert got["out"][6] == [mean, 2 * mean]
        assert got["summed"] == [total, float(world)]
        assert got["one"] == mean
        assert got["alone"] == ([], [total])
        assert got["single"] == (ranks[results.index(got)], True)  # one rank: nothing to combine, no collective
        # float32 mean/sum values + the extra in one; max; min; the float64 mean: four; then 1 + 1
        assert sorted(got["calls"][:4]) == [1, 1, 1, 2 + 2 + 2], got["calls"]
        replicas = [float(k + 1) for k in range(world // 2)]
        assert got["peers"] == ([sum(replicas) / len(replicas), 10 * sum(replicas), max(replicas)], [total])
        assert got["tp_only"] == (3.0, [total])  # one replica: its values stand, the extra is summed over all
        # then 1 + 1; the peers' sum bucket (2 values + extra) and max; the tp-only extra alone
        assert got["calls"][4:] == [1, 1, 3, 1, 1], got["calls"]
