"""The DP engine without Lightning: scatter, replicate, parallel apply, gather, exchange accounting (CPU replicas)."""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
from torch import nn

from lightning_parallel.parallel.counters import (
    DP_KINDS,
    GATHER_OUTPUTS,
    REDUCE_GRADS,
    REPLICATE_PARAMS,
    SCATTER_GRAD,
    SCATTER_INPUTS,
    CommCounter,
)
from lightning_parallel.parallel.data_parallel import (
    BackwardMode,
    DataParallelEngine,
    data_parallel,
    find_sample_count,
    gather,
    parallel_apply,
    replicate,
    scatter,
    split_sizes,
)

CPU = torch.device("cpu")


class Pair(NamedTuple):
    a: torch.Tensor
    b: list[torch.Tensor]


@dataclass(frozen=True)
class Batch:
    x: torch.Tensor
    name: str


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(module(batch[0]), batch[1])


def _data(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize(("total", "parts", "sizes"), [(10, 3, [4, 3, 3]), (8, 2, [4, 4]), (1, 2, [1]), (2, 3, [1, 1]),
                                                       (0, 2, [])])
def test_split_sizes_are_balanced_and_drop_empty_slices(total: int, parts: int, sizes: list[int]) -> None:
    assert split_sizes(total, parts) == sizes


def test_scatter_splits_nested_structures_and_replicates_the_rest() -> None:
    x = torch.arange(10.0).view(5, 2)
    mask = torch.ones(7)  # leading dim != 5 samples: sent whole
    batch = {"inputs": (x, [x[:, 0]]), "pair": Pair(x, [x * 2]), "dc": Batch(x + 1, "n"), "mask": mask,
             "scale": torch.tensor(2.0), "tag": "train"}
    counter = CommCounter()
    slices, sizes = scatter(batch, [CPU, CPU], counter=counter)
    assert sizes == [3, 2] and find_sample_count(batch) == 5
    for key in ("inputs", "pair", "dc"):
        assert type(slices[0][key]) is type(batch[key])
    assert torch.equal(torch.cat([s["inputs"][0] for s in slices]), x)
    assert torch.equal(torch.cat([s["inputs"][1][0] for s in slices]), x[:, 0])
    assert torch.equal(torch.cat([s["pair"].b[0] for s in slices]), x * 2)
    assert torch.equal(torch.cat([s["dc"].x for s in slices]), x + 1) and slices[1]["dc"].name == "n"
    assert all(torch.equal(s["mask"], mask) and s["tag"] == "train" and float(s["scale"]) == 2.0 for s in slices)
    # slice 1 is a real copy (no memory shared with the batch), and its bytes are counted
    assert slices[1]["inputs"][0].data_ptr() != x[3:].data_ptr()
    moved = 4 * (2 * 2 + 2 + 2 * 2 + 2 * 2 + 2 * 2 + 7 + 1)  # slices of 2 rows: x, x[:,0], x, 2x, x+1; mask; scalar
    assert counter.stats()[0].kind == SCATTER_INPUTS and counter.stats()[0].nbytes == moved


def test_scatter_uneven_and_unsplittable_batches() -> None:
    slices, sizes = scatter((torch.zeros(1, 3), torch.zeros(1)), [CPU, CPU, CPU])
    assert sizes == [1] and len(slices) == 1  # fewer samples than devices: fewer replicas
    slices, sizes = scatter({"a": 1, "b": "text"}, [CPU, CPU])
    assert sizes == [1] and slices == [{"a": 1, "b": "text"}]  # nothing to split: device 0 alone


@pytest.mark.parametrize("backward", ["threads", "graph"])
@pytest.mark.parametrize(("devices", "samples"), [(1, 10), (2, 10), (3, 10), (4, 7), (3, 2)])
def test_replicated_gradients_equal_one_device(devices: int, samples: int, backward: BackwardMode) -> None:
    ref, dp = _mlp(), _mlp()
    batch = _data(samples)
    _loss(ref, batch).backward()
    counter = CommCounter()
    engine = DataParallelEngine([CPU] * devices, counter=counter, backward=backward)
    loss = engine.run(dp, batch, _loss, force_reduce=True)
    loss.backward()
    engine.close()
    assert torch.allclose(loss, _loss(ref, batch), atol=1e-6)
    for p, q in zip(dp.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    used = min(devices, samples)
    kinds = [s.kind for s in counter.stats()]
    assert kinds == (list(DP_KINDS) if used > 1 else [])
    if used > 1:
        param_bytes = sum(p.numel() * 4 for p in dp.parameters())
        stats = {s.kind: s for s in counter.stats()}
        assert stats[REPLICATE_PARAMS].nbytes == param_bytes * (used - 1)
        assert stats[REDUCE_GRADS].nbytes == param_bytes * (used - 1)
        assert stats[GATHER_OUTPUTS].nbytes == 4 * (used - 1) and stats[SCATTER_GRAD].nbytes == 4 * (used - 1)


def test_threads_backward_runs_each_replica_backward_in_its_own_thread() -> None:
    threads: set[str] = set()

    class Spy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            y.register_hook(lambda g: (threads.add(threading.current_thread().name), time.sleep(0.05))[1])
            return y.pow(2).mean()

    engine = DataParallelEngine([CPU] * 3, backward="threads")
    assert engine.backward_mode == "threads"
    engine.run(Spy(), torch.randn(6, 4), lambda replica, x: replica(x), force_reduce=True).backward()
    engine.close()
    assert len(threads) == 3  # the calling thread and two workers


@pytest.mark.parametrize("backward", ["threads", "graph"])
def test_unused_parameters_keep_no_gradient_and_tied_weights_sum(backward: BackwardMode) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4, bias=False)
            self.b = nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight
            self.unused = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x))).pow(2).mean()

    torch.manual_seed(0)
    model, ref = Tied(), Tied()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(6, 4)
    data_parallel(model, x, [CPU] * 3, backward=backward).backward()
    ref(x).backward()
    assert model.unused.weight.grad is None
    assert model.a.weight.grad is not None and ref.a.weight.grad is not None
    torch.testing.assert_close(model.a.weight.grad, ref.a.weight.grad, rtol=1e-5, atol=1e-7)


def test_replicas_share_nothing_but_replica_zero_buffers() -> None:
    bn = nn.BatchNorm1d(3)
    replicas = replicate(bn, [CPU, CPU], differentiable=False)
    assert replicas[0].running_mean is bn.running_mean
    assert replicas[1].running_mean is not bn.running_mean
    assert list(replicas[1].parameters()) == []  # replicas hold plain tensors, not Parameters
    assert torch.equal(replicas[1].weight, bn.weight) and replicas[1].weight.data_ptr() != bn.weight.data_ptr()


def test_batch_norm_statistics_are_per_slice_and_running_stats_follow_device_zero() -> None:
    """Documented: BatchNorm normalises each slice with that slice's statistics (not the whole batch's), and the
    running statistics are updated from device 0's slice only, like torch.nn.DataParallel. Not equal to one device."""
    torch.manual_seed(0)
    bn, slice0_bn = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    x = torch.randn(8, 3) * 3 + 1
    out = data_parallel(bn, x, [CPU, CPU])
    slice0_bn(x[:4])
    torch.testing.assert_close(bn.running_mean, slice0_bn.running_mean)
    torch.testing.assert_close(out[:4], nn.functional.batch_norm(x[:4], None, None, training=True))
    assert not torch.allclose(out, nn.functional.batch_norm(x, None, None, training=True), atol=1e-3)


def test_gather_concatenates_per_sample_outputs_and_weights_means() -> None:
    sizes = [3, 2]
    outputs = [{"loss": torch.tensor(1.0), "pred": torch.zeros(3, 2), "acc": 0.5, "n": torch.tensor(3), "k": 7},
               {"loss": torch.tensor(2.0), "pred": torch.ones(2, 2), "acc": 1.0, "n": torch.tensor(2), "k": 9}]
    out = gather(outputs, sizes, CPU)
    assert float(out["loss"]) == pytest.approx(1.0 * 0.6 + 2.0 * 0.4)
    assert out["pred"].shape == (5, 2) and out["acc"] == pytest.approx(0.7) and int(out["n"]) == 5 and out["k"] == 7
    assert float(gather([torch.tensor(1.0), torch.tensor(2.0)], sizes, CPU, reduction="sum")) == 3.0
    assert gather([None, None], sizes, CPU) is None
    with pytest.raises(ValueError, match="returned None"):
        gather([None, torch.tensor(1.0)], sizes, CPU)


def test_parallel_apply_uses_threads_and_propagates_grad_mode() -> None:
    seen: dict[int, tuple[str, bool, bool]] = {}
    barrier = threading.Barrier(3, timeout=10)  # passes only if the three replicas run at the same time

    def work(i: int) -> int:
        barrier.wait()
        seen[i] = (threading.current_thread().name, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        return i * i

    with torch.inference_mode():
        assert parallel_apply(work, [CPU] * 3) == [0, 1, 4]
    assert len({name for name, _, _ in seen.values()}) == 3
    assert all(not grad and inference for _, grad, inference in seen.values())


def test_parallel_apply_reraises_the_replica_error_with_its_index() -> None:
    def work(i: int) -> int:
        if i == 1:
            raise KeyError("boom")
        return i

    with pytest.raises(KeyError, match="boom") as info:
        parallel_apply(work, [CPU] * 2)
    assert any("replica 1" in note for note in getattr(info.value, "__notes__", ["replica 1"]))


def test_thread_counts_are_set_when_the_pool_starts_never_while_a_replica_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.set_num_threads`` resizes process-wide pools: called by one replica thread while another runs kernels,
    it is a race (a CI run crashed with SIGSEGV in a first step's embedding). Every thread's count is set when the
    engine's pool starts, on the caller and on each worker, and no call happens inside a step."""
    running = threading.Event()
    calls: list[tuple[str, int, bool]] = []
    real = torch.set_num_threads

    def recording(count: int) -> None:
        calls.append((threading.current_thread().name, count, running.is_set()))
        real(count)

    monkeypatch.setattr(torch, "set_num_threads", recording)
    saved = torch.get_num_threads()
    real(2)  # a count other than the engine's, so that the old code's per-step calls would show
    engine = DataParallelEngine([CPU] * 3, cpu_threads=1)
    try:
        def work(i: int) -> int:
            running.set()
            return i + int(torch.ones(3).add(1).sum())

        assert engine.apply(work, 3) == [6, 7, 8]
        assert engine.apply(work, 3) == [6, 7, 8]
    finally:
        engine.close()
        real(saved)
    assert [(n, c) for n, c, during in calls if during] == []
    names = [name for name, count, _ in calls if count == 1]
    assert names[0] == threading.current_thread().name and len(set(names)) == 3  # the caller, then both workers


def test_engine_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one device"):
        DataParallelEngine([])
    with pytest.raises(ValueError, match="reduction"):
        DataParallelEngine([CPU], reduction="max")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_replicas_equal_one_device() -> None:
    devices = [torch.device("cuda", i) for i in range(2)]
    ref, dp = _mlp().to(devices[0]), _mlp().to(devices[0])
    batch = tuple(t.to(devices[0]) for t in _data(10))
    _loss(ref, batch).backward()  # type: ignore[arg-type]
    data_parallel(dp, batch, devices)  # warm-up path check
    dp.zero_grad(set_to_none=True)
    engine = DataParallelEngine(devices)
    engine.run(dp, batch, _loss, force_reduce=True).backward()
    for p, q in zip(dp.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_exchange_counter_survives_pickling() -> None:
    """The spawn launchers pickle the strategy (lp_ddp, lp_dp hold a counter): the lock is made anew, the tally kept."""
    counter = CommCounter()
    counter.record("allreduce", 8)
    copy = pickle.loads(pickle.dumps(counter))
    copy.record("allreduce", 4)
    assert [(s.kind, s.nbytes) for s in copy.stats()] == [("allreduce", 12)]
