"""Exact mid-epoch resume with the user's own DataLoader, no library data code: the training DataLoader's sampler is
fast-forwarded (:mod:`lightning_parallel.data.fast_forward`).

The user's data module builds ``DataLoader(ds, batch_size, sampler=DistributedSampler(ds, shuffle=False, ...))``
(rank and size from ``trainer.distributed_sampler_kwargs``); epochs are :data:`EPOCH` global batches long, a
checkpoint is taken at step :data:`STOP` (mid-epoch 1) and the run stops there, then resumes -- under another layout
-- to step :data:`STEPS`. The resumed weights must equal the uninterrupted one-device run's. Without the fast-forward
(Lightning alone) the resumed epoch starts again from its first batch and ends ~4e-3 away (the control below).
Lightning's own one-device strategy gets the fast-forward from the ``ResumableDataLoaders`` callback (the CLI adds
it to every run); the library's strategies do it themselves. ``-s`` prints every result.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, TensorDataset

from lightning_parallel.callbacks import ResumableDataLoaders
from lightning_parallel.data import ResumableDataModuleMixin
from lightning_parallel.models import GPT
from lightning_parallel.strategies import (
    LPDDPStrategy,
    LPPipelineStrategy,
    LPShardedStrategy,
    LPTensorStrategy,
)
from lightning_parallel.testing.resume_matrix import _deepspeed_ready

G, EPOCH, STOP, STEPS, T, VOCAB = 8, 4, 6, 10, 16, 64
TOL = 1e-5
FORK: dict[str, Any] = {"start_method": "fork"}


def _tokens(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    base = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    data = (base + stride * torch.arange(T + 1)) % VOCAB
    return TensorDataset(data[:, :-1], data[:, 1:])


class UserData(pl.LightningDataModule):
    """The user's data: nothing of the library. ``kind``: ``distributed`` (the DataLoader of issue 25),
    ``random`` (``RandomSampler`` with a seeded generator), ``plain_shuffle`` (``shuffle=True``: Lightning inserts
    its own ``DistributedSampler``), ``stream`` (an ``IterableDataset``), ``stateful`` (torchdata's
    ``StatefulDataLoader`` around the distributed sampler)."""

    def __init__(self, batch_size: int, kind: str = "distributed") -> None:
        super().__init__()
        self.ds, self.batch_size, self.kind = _tokens(EPOCH * G), batch_size, kind

    def train_dataloader(self) -> Any:
        if self.kind == "random":
            return DataLoader(self.ds, batch_size=self.batch_size,
                              sampler=RandomSampler(self.ds, generator=torch.Generator().manual_seed(3)))
        if self.kind == "plain_shuffle":
            return DataLoader(self.ds, batch_size=self.batch_size, shuffle=True)
        if self.kind == "stream":
            return DataLoader(_Stream(self.ds), batch_size=self.batch_size)
        kwargs = self.trainer.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(self.ds, shuffle=False, **kwargs)
        if self.kind == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(self.ds, batch_size=self.batch_size, sampler=sampler)
        return DataLoader(self.ds, batch_size=self.batch_size, sampler=sampler)


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __init__(self, ds: TensorDataset) -> None:
        self.ds = ds

    def __iter__(self) -> Any:
        return iter(self.ds)


class _StopAt(Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= STOP:
            trainer.should_stop = True


LAYOUTS: dict[str, tuple[Callable[[], Any], int, int]] = {  # name: (strategy, devices, dp)
    "1 device": (lambda: "auto", 1, 1),
    "lp_ddp x2": (lambda: LPDDPStrategy(**FORK), 2, 2),
    "lp_sharded z3 x2": (lambda: LPShardedStrategy({"zero_stage": 3}, **FORK), 2, 2),
    "lp_tensor tp2": (lambda: LPTensorStrategy({"tensor_parallel_size": 2}, **FORK), 2, 1),
    "lp_pipeline pp2": (lambda: LPPipelineStrategy({"pipeline_parallel_size": 2, "num_micro_batches": 2,
                                                     "pipeline_schedule": "1f1b"}, **FORK), 2, 1),
}
if _deepspeed_ready():
    from lightning_parallel.strategies.zero_offload import LPZeroOffloadStrategy

    LAYOUTS["lp_zero_offload x2"] = (lambda: LPZeroOffloadStrategy({"zero_stage": 2, "offload": "cpu"}, **FORK), 2, 2)


def _fit(layout: str, *, kind: str = "distributed", ckpt: str | None = None, save_to: Path | None = None,
         fast_forward: bool = True, **trainer_kw: Any) -> nn.Module:
    make, devices, dp = LAYOUTS[layout]
    torch.manual_seed(0)
    model = GPT(n_layer=2, n_head=2, n_embd=32, block_size=T, vocab_size=VOCAB, warmup_steps=2, bias=False)
    callbacks: list[Callback] = [ResumableDataLoaders()] if fast_forward else []
    if save_to is not None:
        callbacks += [ModelCheckpoint(dirpath=save_to, filename="stop", every_n_train_steps=STOP, save_top_k=-1),
                      _StopAt()]
    kwargs: dict[str, Any] = dict(accelerator="cpu", devices=devices, strategy=make(), max_steps=STEPS, logger=False,
                                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                  limit_val_batches=0, gradient_clip_val=0.5, use_distributed_sampler=False,
                                  enable_checkpointing=save_to is not None, callbacks=callbacks)
    kwargs.update(trainer_kw)
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model, datamodule=UserData(G // dp, kind), ckpt_path=ckpt)
    return model


def _diff(a: nn.Module, b: nn.Module) -> float:
    sb = b.state_dict()
    return max(float((v.float() - sb[k].float()).abs().max()) for k, v in a.state_dict().items())


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    os.environ.setdefault("LIGHTNING_PARALLEL_TRUST_CHECKPOINTS", "1")


def test_the_users_distributed_sampler_resumes_mid_epoch_under_another_layout(tmp_path: Path) -> None:
    reference = _fit("1 device")
    lines = []

    def check(saved: str, resumed: str, path: Path, **kw: Any) -> float:
        diff = _diff(_fit(resumed, ckpt=str(path), **kw), reference)
        lines.append(f"saved at step {STOP} (mid-epoch 1) under {saved:<10} resumed under {resumed:<18} "
                     f"max |w - w_uninterrupted 1 device| after step {STEPS}: {diff:.1e}")
        return diff

    _fit("lp_ddp x2", save_to=tmp_path / "ddp")
    saved_ddp = tmp_path / "ddp" / "stop.ckpt"
    diffs = [check("lp_ddp x2", name, saved_ddp) for name in LAYOUTS if name != "lp_ddp x2"]
    _fit("1 device", save_to=tmp_path / "one")
    diffs.append(check("1 device", "lp_ddp x2", tmp_path / "one" / "stop.ckpt"))
    print("\n" + "\n".join(lines))
    assert max(diffs) < TOL, "\n".join(lines)
    loops = torch.load(saved_ddp, weights_only=True)["loops"]["fit_loop"]
    assert loops["epoch_loop.batch_progress"]["current"]["processed"] == 2  # 4-batch epochs: step 6 is batch 2 of 1
    assert "combined_loader" not in loops["state_dict"]  # nothing new in the checkpoint: Lightning alone reads it


def test_a_module_that_reads_the_stepping_batches_resumes_mid_epoch_too(tmp_path: Path) -> None:
    """With ``max_epochs`` (no ``max_steps``) the GPT's ``configure_optimizers`` reads the Trainer's
    ``estimated_stepping_batches`` for its schedule, which loads the training data during setup -- before the
    checkpoint is restored; the fast-forward then reads the restored position when the epoch's iteration starts.
    Before, the resumed epoch replayed its first batches (silently)."""
    epochs = {"max_steps": -1, "max_epochs": 3}
    reference = _fit("1 device", **epochs)
    _fit("lp_ddp x2", save_to=tmp_path, **epochs)
    diff = _diff(_fit("lp_ddp x2", ckpt=str(tmp_path / "stop.ckpt"), **epochs), reference)
    print(f"\nmax_epochs=3, saved at step {STOP} (mid-epoch 1) under lp_ddp x2, resumed under lp_ddp x2: "
          f"max |w - w_uninterrupted 1 device| = {diff:.1e}")
    assert diff < TOL


def test_without_the_fast_forward_the_resumed_epoch_replays_batches(tmp_path: Path) -> None:
    """Control (Lightning alone, the issue's 1.2e-2): the epoch restarts from its first batch. The same checkpoint,
    written by Lightning alone, resumes exactly under a library strategy (the loop's restored position is
    fast-forwarded)."""
    reference = _fit("1 device", fast_forward=False)
    _fit("1 device", save_to=tmp_path, fast_forward=False)
    path = str(tmp_path / "stop.ckpt")
    assert "combined_loader" not in torch.load(path, weights_only=True)["loops"]["fit_loop"]["state_dict"]
    replayed = _diff(_fit("1 device", ckpt=path, fast_forward=False), reference)
    fallback = _diff(_fit("lp_ddp x2", ckpt=path), reference)
    print(f"\nLightning alone, resumed at step {STOP}: max |w - w_uninterrupted| = {replayed:.1e}; the same checkpoint "
          f"resumed under lp_ddp x2: {fallback:.1e}")
    assert replayed > 1e-3
    assert fallback < TOL


@pytest.mark.parametrize(("layout", "kind"), [("1 device", "random"), ("lp_ddp x2", "plain_shuffle"),
                                              ("lp_ddp x2", "stateful")])
def test_shuffled_and_stateful_loaders_resume_exactly(tmp_path: Path, layout: str, kind: str) -> None:
    """``RandomSampler`` with a seeded generator (the earlier epochs' draws are replayed), the sampler Lightning
    inserts for ``shuffle=True`` (``use_distributed_sampler=True``), torchdata's ``StatefulDataLoader`` (left to
    Lightning): the resumed run equals the uninterrupted run of the same layout."""
    if kind == "stateful":
        pytest.importorskip("torchdata.stateful_dataloader")
    kw = {"use_distributed_sampler": kind == "plain_shuffle"}
    reference = _fit(layout, kind=kind, **kw)
    _fit(layout, kind=kind, save_to=tmp_path, **kw)
    diff = _diff(_fit(layout, kind=kind, ckpt=str(tmp_path / "stop.ckpt"), **kw), reference)
    control = _diff(_fit(layout, kind=kind, **{**kw, "max_steps": STEPS - 1}), reference)
    print(f"\n{layout}, {kind}: resumed at step {STOP} vs uninterrupted: {diff:.1e} (one step fewer: {control:.1e})")
    assert diff < TOL
    assert control > 1e-4  # the check can see a difference of one step


def test_an_iterable_dataset_without_state_gets_a_warning_on_a_mid_epoch_resume(tmp_path: Path) -> None:
    _fit("1 device", kind="stream", save_to=tmp_path)
    with pytest.warns(UserWarning, match=r"IterableDataset _Stream, which has no state_dict\(\)") as record:
        _fit("1 device", kind="stream", ckpt=str(tmp_path / "stop.ckpt"))
    message = next(str(w.message) for w in record if "_Stream" in str(w.message))
    assert "2 batch(es) already run in this epoch are seen again" in message, message
    assert "the weights, optimizer, LR schedulers, RNG states and loop counters come back" in message


class _Seen(pl.LightningModule):
    """Records the sample ids of every training batch; reads ``estimated_stepping_batches`` in
    ``configure_optimizers`` when ``estimate`` (as a schedule does: the data is loaded before the restore).
    ``order``: ``"distributed"`` a ``DistributedSampler`` (shuffled from ``seed + epoch`` when ``shuffle``),
    ``"generator"`` a ``RandomSampler`` drawing from a generator the loader's code seeds, ``"loader"``
    ``DataLoader(shuffle=True, generator=...)`` (the iterator draws its workers' seed from that generator too),
    ``"persistent"`` the same with persistent workers (one iterator for the whole fit)."""

    def __init__(self, workers: int, shuffle: bool, estimate: bool, order: str = "distributed") -> None:
        super().__init__()
        self.layer, self.seen = nn.Linear(1, 1), []  # type: ignore[var-annotated]
        self.workers, self.shuffle, self.estimate, self.order = workers, shuffle, estimate, order

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.seen.append(batch[0].flatten().int().tolist())
        return self.layer(batch[0]).sum()

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self.layer(batch[0])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass

    def val_dataloader(self) -> Any:
        return DataLoader(TensorDataset(torch.arange(4).float().unsqueeze(1)), batch_size=2)

    def configure_optimizers(self) -> Any:
        if self.estimate:
            assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> Any:
        data = TensorDataset(torch.arange(16).float().unsqueeze(1))
        seeded = torch.Generator().manual_seed(5)
        if self.order == "generator":
            return DataLoader(data, batch_size=2, num_workers=self.workers,
                              sampler=RandomSampler(data, generator=seeded))
        if self.order in ("loader", "persistent"):
            return DataLoader(data, batch_size=2, num_workers=self.workers, shuffle=True, generator=seeded,
                              persistent_workers=self.order == "persistent")
        return DataLoader(data, batch_size=2, num_workers=self.workers,
                          sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=self.shuffle, seed=0))


class _LibraryData(ResumableDataModuleMixin, pl.LightningDataModule):
    """The library's own resumable data module (``ResumableSampler``, its position saved in the checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        self.ds = TensorDataset(torch.arange(16).float().unsqueeze(1))

    def train_dataloader(self) -> Any:
        return DataLoader(self.ds, batch_size=2, drop_last=True,
                          sampler=self.resumable_sampler(self.ds, 2, shuffle=True, seed=0))


def _case(workers: int, shuffle: bool, estimate: bool, stop: int, library: bool = False, order: str = "distributed",
          **trainer: Any) -> Any:
    name = f"{order}-w{workers}-stop{stop}" + ("-shuffle" if shuffle else "") + ("-estimate" if estimate else "") + (
        "-library" if library else "") + "".join(f"-{k}={v}" for k, v in trainer.items())
    return pytest.param(workers, shuffle, estimate, stop, library, order, trainer, id=name)


@pytest.mark.parametrize(("workers", "shuffle", "estimate", "stop", "library", "order", "trainer_kw"), [
    _case(1, False, True, 11), _case(1, True, True, 11), _case(1, True, False, 11), _case(0, True, True, 11),
    _case(1, True, True, 8), _case(0, True, True, 11, library=True),
    _case(0, True, False, 16, order="generator"), _case(1, True, True, 8, order="generator"),
    _case(0, True, False, 19, order="generator"), _case(0, True, False, 19, order="loader"),
    _case(1, True, True, 16, order="loader"), _case(1, True, False, 19, order="persistent"),
    _case(1, True, False, 8, order="generator"), _case(2, True, False, 16, order="generator"),
    _case(1, True, False, 16, max_steps=24, max_epochs=-1),
    _case(1, True, False, 14, order="generator", limit_train_batches=0.75),
    _case(0, True, False, 16, order="generator", reload_dataloaders_every_n_epochs=1),
    _case(0, True, False, 16, order="generator", reload_dataloaders_every_n_epochs=2, max_epochs=4),
    _case(0, True, False, 8, order="loader", val_check_interval=8, limit_val_batches=1)])
def test_a_resumed_epoch_takes_its_own_batches_with_loader_workers(tmp_path: Path, workers: int, shuffle: bool,
                                                                   estimate: bool, stop: int, library: bool,
                                                                   order: str, trainer_kw: dict[str, Any]) -> None:
    """Epochs of 8 batches, 3 of them, saved at step ``stop`` (11 and 19: 3 batches into epochs 1 and 2; 8 and 16:
    after epoch 0's and 1's last batch), resumed: the batches must be the uninterrupted run's rest. With a loader
    worker the first iterator draws its indices when it is created: before the checkpoint is restored when the data
    is loaded for ``estimated_stepping_batches`` (the epoch replayed its first batches; after an epoch-end checkpoint
    it took epoch 0's order), before Lightning sets the sampler's epoch (a shuffled resumed epoch took epoch 0's
    order), and before Lightning moves past an epoch saved after its last batch (the resumed fit skipped a whole
    epoch of training). ``library``: the library's data module, whose position the reload must not lose. A generator
    the loader's code seeds starts again at its seed in the resumed run: the epochs before are drawn again (after an
    epoch-end checkpoint too: the resumed epoch took epoch 0's order), with the draw each iterator makes for its
    workers' seed when the loader shares the generator and the batches the workers read ahead (under
    ``limit_train_batches`` too); since the last reload with ``reload_dataloaders_every_n_epochs`` (whose schedule the
    resumed fit keeps: Lightning counts it from the resumed epoch); and a validation-end checkpoint after an epoch's
    last batch (Lightning makes an iterator for the saved epoch and drops it: its seed draw counts)."""
    class Stop(Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step >= stop:
                trainer.should_stop = True

    def run(ckpt: str | None = None, save: bool = False) -> list[list[int]]:
        callbacks: list[Callback] = [ResumableDataLoaders()]
        if save:
            every = None if "val_check_interval" in trainer_kw else stop  # else saved at the validation's end
            callbacks += [ModelCheckpoint(dirpath=tmp_path, filename="stop", every_n_train_steps=every,
                                          save_on_train_epoch_end=False), Stop()]
        module = _Seen(workers, shuffle, estimate, order)
        kw: dict[str, Any] = {"max_epochs": 3, "limit_val_batches": 0, **trainer_kw}
        pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0,
                   enable_checkpointing=save, callbacks=callbacks, **kw).fit(
                       module, datamodule=_LibraryData() if library else None, ckpt_path=ckpt)
        return module.seen

    uninterrupted = run()
    run(save=True)
    resumed = run(ckpt=str(tmp_path / "stop.ckpt"))
    print(f"\norder={order} workers={workers} shuffle={shuffle} estimated_stepping_batches={estimate} stop={stop} "
          f"library={library} {trainer_kw}: resumed {len(resumed)} batches {resumed[:4]}..., uninterrupted rest "
          f"{len(uninterrupted) - stop} {uninterrupted[stop:stop + 4]}...")
    assert resumed == uninterrupted[stop:]


def test_the_users_loader_is_left_as_it_is() -> None:
    """The fast-forward wraps a copy's sampler: the user's loader, fitted on, still predicts (Lightning rebuilds it
    with its own sampler; a wrapped sampler refused the rebuild's keyword arguments) and keeps its sampler."""
    module = _Seen(0, False, False)
    loader = module.train_dataloader()
    sampler = loader.batch_sampler
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[ResumableDataLoaders()])
    trainer.fit(module, train_dataloaders=loader)
    assert loader.batch_sampler is sampler and not hasattr(loader, "_lp_fast_forward")
    predictions = trainer.predict(module, loader)
    assert predictions is not None and len(predictions) == len(loader)


def test_the_library_data_module_resumes_under_a_strategy_that_restores_after_setup(tmp_path: Path) -> None:
    """``lp_sharded`` restores the checkpoint after its setup, where ``estimated_stepping_batches`` asks the library's
    data module for its loader before the position is set: the reload after the restore must ask again (rank 0's
    batches after a save at step 6, mid-epoch 1, against the uninterrupted run's; ``[[5, 6], [11, 7]]`` against
    ``[[1, 9], [10, 13]]`` when such loaders were not reloaded)."""
    import json

    class Dump(Callback):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
            if trainer.global_rank == 0:
                (tmp_path / f"{self.name}.json").write_text(json.dumps(module.seen))

    def run(name: str, ckpt: str | None = None, save: bool = False) -> list[list[int]]:
        callbacks: list[Callback] = [Dump(name)]
        if save:
            callbacks += [ModelCheckpoint(dirpath=tmp_path, filename="stop", every_n_train_steps=6), _StopAt()]
        pl.Trainer(accelerator="cpu", devices=2, strategy=LPShardedStrategy({"zero_stage": 1}, **FORK), max_epochs=2,
                   logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                   limit_val_batches=0, enable_checkpointing=save, callbacks=callbacks,
                   use_distributed_sampler=False).fit(_Seen(0, True, True), datamodule=_LibraryData(), ckpt_path=ckpt)
        return json.loads((tmp_path / f"{name}.json").read_text())  # type: ignore[no-any-return]

    uninterrupted = run("full")
    run("save", save=True)
    resumed = run("resumed", ckpt=str(tmp_path / "stop.ckpt"))
    print(f"\nlp_sharded, the library's data module, resumed at step 6: {resumed} vs {uninterrupted[6:]}")
    assert resumed == uninterrupted[6:]
