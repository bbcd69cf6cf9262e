"""``lightning_parallel.checkpoint`` on hand-made files: format detection and its refusals, the ZeRO-3 shard join,
wrapper names, consolidation and the ``consolidate`` command's errors. No training, no process group."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_parallel.checkpoint import (
    CheckpointFormatError,
    consolidate,
    detect_format,
    full_checkpoint,
    full_state_dict,
    join_zero3_shards,
    main,
    strip_wrapper_prefixes,
)
from lightning_parallel.models import GPT
from tests.helpers import tiny_gpt

# ------------------------------------------------------------------------------------------------ names


def test_wrapper_components_are_removed_anywhere_and_leading_prefixes_only_when_shared() -> None:
    state = {"blocks.0._checkpoint_wrapped_module.attn.q_proj.weight": 1, "_orig_mod.head.weight": 2,
             "blocks.1._fsdp_wrapped_module.mlp.fc_in.bias": 3}
    assert strip_wrapper_prefixes(state) == {"blocks.0.attn.q_proj.weight": 1, "head.weight": 2,
                                             "blocks.1.mlp.fc_in.bias": 3}
    wrapped = {"_forward_module.module.a.weight": 1, "_forward_module.module.b": 2}
    assert strip_wrapper_prefixes(wrapped, leading=("_forward_module.", "module.")) == {"a.weight": 1, "b": 2}
    # a module's own child called "module" is kept unless asked, and a prefix not shared by every key stays
    assert strip_wrapper_prefixes({"module.w": 1}) == {"module.w": 1}
    assert strip_wrapper_prefixes({"module.w": 1, "head.w": 2}, leading=("module.",)) == {"module.w": 1, "head.w": 2}
    with pytest.raises(ValueError, match="collide"):
        strip_wrapper_prefixes({"a._orig_mod.w": 1, "a.w": 2})


# ------------------------------------------------------------------------------------------------ ZeRO-3 shards


def _shard(full: torch.Tensor, world: int) -> list[torch.Tensor]:
    """FSDP2's Shard(0) local pieces: torch.chunk, ranks past the last chunk hold an empty piece."""
    pieces = list(torch.chunk(full, world, dim=0))
    return pieces + [full[:0]] * (world - len(pieces))


def test_zero3_shards_join_uneven_pieces_and_keep_replicated_buffers_once() -> None:
    g = torch.Generator().manual_seed(0)
    full = {"emb.weight": torch.randn(5, 3, generator=g), "ln.bias": torch.randn(1, generator=g),
            "w": torch.randn(4, 2, generator=g), "calib": torch.arange(4.0), "steps": torch.tensor(7)}
    params = ("emb.weight", "ln.bias", "w")
    world = 2
    parts: list[dict[str, Any]] = [{} for _ in range(world)]
    for key, value in full.items():
        pieces = _shard(value, world) if key in params else [value.clone()] * world
        for part, piece in zip(parts, pieces, strict=True):
            part[key] = piece
    assert [tuple(p["emb.weight"].shape) for p in parts] == [(3, 3), (2, 3)]
    assert [tuple(p["ln.bias"].shape) for p in parts] == [(1,), (0,)]
    joined = join_zero3_shards(parts, n_params=len(params), where=Path("x"))
    assert joined.keys() == full.keys()
    for key, value in full.items():
        assert torch.equal(joined[key], value), key


def test_zero3_shards_that_do_not_belong_together_are_refused() -> None:
    a = {"w": torch.randn(3, 2)}
    with pytest.raises(CheckpointFormatError, match="not dim-0 shards"):
        join_zero3_shards([a, {"w": torch.randn(3, 4)}], n_params=1, where=Path("f"))
    with pytest.raises(CheckpointFormatError, match="not dim-0 shards"):  # 1 + 3 rows is not a chunk split of 4
        join_zero3_shards([{"w": torch.randn(1, 2)}, {"w": torch.randn(3, 2)}], n_params=1, where=Path("f"))
    with pytest.raises(CheckpointFormatError, match="other keys"):
        join_zero3_shards([a, {"v": torch.randn(3, 2)}], n_params=1, where=Path("f"))
    # a parameter whose two halves are equal looks replicated: the optimizer's count gives it away
    same = torch.ones(2, 2)
    with pytest.raises(CheckpointFormatError, match="identical"):
        join_zero3_shards([{"w": same}, {"w": same.clone()}], n_params=1, where=Path("f"))


# ------------------------------------------------------------------------------------------------ hand-made checkpoints


def _lightning_checkpoint(model: GPT) -> dict[str, Any]:
    return {"epoch": 1, "global_step": 3, "pytorch-lightning_version": "2.6.6", "loops": {}, "callbacks": {},
            "state_dict": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer_states": [{"state": {}, "param_groups": []}], "lr_schedulers": [{"last_epoch": 3}],
            "hparams_name": "kwargs", "hyper_parameters": dict(model.hparams)}


@pytest.fixture
def gpt() -> GPT:
    return tiny_gpt()


def test_lightning_file_round_trip_and_consolidate(tmp_path: Path, gpt: GPT) -> None:
    src = tmp_path / "a.ckpt"
    ckpt = _lightning_checkpoint(gpt)
    ckpt["state_dict"] = {k.replace("attn.", "attn._checkpoint_wrapped_module."): v
                          for k, v in ckpt["state_dict"].items()}  # as an activation-checkpointing wrapper may leave
    torch.save(ckpt, src)
    info = detect_format(src)
    assert info.format == "lightning" and info.describe() == "Lightning file"
    state = full_state_dict(src)
    assert list(state) == list(gpt.state_dict())
    full = full_checkpoint(src)
    assert "optimizer_states" not in full and "lr_schedulers" not in full and full["global_step"] == 3
    result = consolidate(src, tmp_path / "out" / "b.ckpt")  # the folder is created
    assert result.tensors == len(state) and result.parameters == sum(v.numel() for v in state.values())
    assert result.dropped == ("optimizer_states", "lr_schedulers")
    assert "[Lightning file]" in result.summary() and "states dropped" in result.summary()
    written = torch.load(result.output, weights_only=True)
    assert sorted(written) == sorted(k for k in ckpt if k not in ("optimizer_states", "lr_schedulers"))
    loaded = GPT.load_from_checkpoint(result.output, map_location="cpu")
    assert all(torch.equal(v, gpt.state_dict()[k]) for k, v in loaded.state_dict().items())
    assert not list(tmp_path.glob("out/.*tmp*"))  # no temporary file left behind


def _write_sharded(folder: Path, gpt: GPT, stage: int, world: int = 2) -> None:
    folder.mkdir()
    meta = _lightning_checkpoint(gpt)
    meta.pop("optimizer_states")
    meta["lp_sharded_checkpoint"] = {"zero_stage": stage, "world_size": world}
    full = meta.pop("state_dict")
    n = len(full)
    for r in range(world):
        own: dict[str, Any] = {"optimizer_states": [{"state": {}, "param_groups": [{"params": list(range(n))}]}]}
        if stage == 3:
            own["state_dict"] = {k: _shard(v, world)[r].clone() for k, v in full.items()}
        torch.save(own, folder / f"rank_{r:05d}.pt")
    if stage != 3:
        meta["state_dict"] = full
    torch.save(meta, folder / "meta.pt")


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_folder(tmp_path: Path, gpt: GPT, stage: int) -> None:
    folder = tmp_path / "s.ckpt"
    _write_sharded(folder, gpt, stage, world=3)  # 3 ranks: uneven pieces (vocab 64, hidden 32 over 3)
    info = detect_format(folder)
    assert (info.format, info.zero_stage, info.world_size) == ("lp_sharded", stage, 3)
    state = full_state_dict(folder)
    assert state.keys() == gpt.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in gpt.state_dict().items())
    assert "lp_sharded_checkpoint" not in full_checkpoint(folder)


# ------------------------------------------------------------------------------------------------ refusals


class _Custom:
    pass


def test_refusals_name_the_file_and_what_was_expected(tmp_path: Path, gpt: GPT) -> None:
    def refused(path: Path, *fragments: str) -> None:
        with pytest.raises(CheckpointFormatError) as err:
            full_state_dict(path)
        message = str(err.value)
        assert str(path) in message and ("expected" in message or "trust" in message), message
        for fragment in fragments:
            assert fragment in message, message

    refused(tmp_path / "missing.ckpt", "no such file or folder")
    (tmp_path / "notes.txt").write_text("hello")
    refused(tmp_path / "notes.txt", "not a checkpoint")
    torch.save(gpt.state_dict(), tmp_path / "bare.pt")
    refused(tmp_path / "bare.pt", "bare state dict")
    good = tmp_path / "good.ckpt"
    torch.save(_lightning_checkpoint(gpt), good)
    (tmp_path / "truncated.ckpt").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    refused(tmp_path / "truncated.ckpt", "truncated")
    flipped = bytearray(good.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    (tmp_path / "flipped.ckpt").write_bytes(bytes(flipped))
    refused(tmp_path / "flipped.ckpt", "checksum mismatch")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    refused(tmp_path / "empty.ckpt", "0 bytes")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "x.bin").write_bytes(b"\0")
    refused(tmp_path / "foreign", "neither meta.pt nor a DeepSpeed checkpoint")
    _write_sharded(tmp_path / "sharded", gpt, 3)
    refused(tmp_path / "sharded" / "meta.pt", "pass the folder")
    (tmp_path / "sharded" / "rank_00001.pt").unlink()
    refused(tmp_path / "sharded", "rank_00001.pt is missing")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "latest").write_text("checkpoint")
    refused(tmp_path / "ds", "names the tag 'checkpoint'")
    pickled = _lightning_checkpoint(gpt)
    pickled["hyper_parameters"]["thing"] = _Custom()
    torch.save(pickled, tmp_path / "pickled.ckpt")
    refused(tmp_path / "pickled.ckpt", "weights_only=True", "--trust")
    assert full_state_dict(tmp_path / "pickled.ckpt", trusted=True).keys() == gpt.state_dict().keys()


def test_deepspeed_folder_refusals(tmp_path: Path) -> None:
    """Hand-made DeepSpeed folders: incomplete ones, and an NVMe-offloaded one without lp_zero_offload's NVMe state
    (DeepSpeed's partitions are not relied on for NVMe-offloaded weights) are refused before anything is rebuilt."""
    folder, tag = tmp_path / "ds.ckpt", tmp_path / "ds.ckpt" / "checkpoint"
    tag.mkdir(parents=True)
    (folder / "latest").write_text("checkpoint\n")
    zero = {"stage": 3, "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}}
    torch.save({"module": {}, "buffer_names": [], "param_shapes": [], "dp_world_size": 2,
                "ds_config": {"zero_optimization": zero}}, tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointFormatError, match=r"1 \*_model_states.pt and 0 \*_optim_states.pt"):
        detect_format(folder)
    torch.save({}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointFormatError, match="2 data-parallel ranks, but 1"):
        detect_format(folder)
    torch.save({}, tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointFormatError, match=r"NVMe offload.*0 lp_offload_rank"):
        full_state_dict(folder)


# ------------------------------------------------------------------------------------------------ the command


def test_consolidate_command(tmp_path: Path, gpt: GPT, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_parallel.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["consolidate", "--help"])
    assert exit_info.value.code == 0
    assert "IN" in capsys.readouterr().out
    src = tmp_path / "a.ckpt"
    torch.save(_lightning_checkpoint(gpt), src)
    assert cli_main(["consolidate", str(src), str(tmp_path / "b.ckpt")]) == 0
    out = capsys.readouterr()
    assert len(out.out.strip().splitlines()) == 1 and "35 tensors" in out.out
    cases = {
        "missing input": ([str(tmp_path / "nope.ckpt"), str(tmp_path / "c.ckpt")], "no such file or folder"),
        "input is output": ([str(src), str(src)], "the input checkpoint itself"),
        "output is a folder": ([str(src), str(tmp_path)], "existing folder"),
        "unwritable output": ([str(src), str(src / "sub" / "c.ckpt")], "cannot write"),  # below a file
    }
    for name, (args, fragment) in cases.items():
        assert main(args) == 1, name
        err = capsys.readouterr().err
        assert fragment in err and err.startswith("lightning-parallel consolidate: error:"), (name, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, (name, err)
    assert collections.Counter(p.name for p in tmp_path.iterdir())["c.ckpt"] == 0


def test_a_checkpoint_folder_is_verified_against_its_checksum_list(tmp_path: Path) -> None:
    from lightning_parallel.checkpoint.verify import MANIFEST_FILE, verify_folder, write_manifest

    folder = tmp_path / "last.ckpt"
    (folder / "sub").mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    (folder / "sub" / "meta.pt").write_bytes(b"meta" * 100)
    write_manifest(folder)
    verify_folder(folder)  # intact
    legacy = tmp_path / "legacy"  # no list: its .pt torch archives are checked against their own CRCs
    legacy.mkdir()
    torch.save({"x": torch.ones(3)}, legacy / "rank_00000.pt")
    verify_folder(legacy)
    (legacy / "rank_00001.pt").write_bytes(b"")
    with pytest.raises(CheckpointFormatError, match="0 bytes"):
        verify_folder(legacy)
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[5000] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match=r"__0_0\.distcp: checksum mismatch"):
        verify_folder(folder)
    shard.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointFormatError, match="truncated or replaced"):
        verify_folder(folder)
    shard.unlink()
    with pytest.raises(CheckpointFormatError, match=f"is missing \\(listed in {MANIFEST_FILE}\\)"):
        verify_folder(folder)


def test_trusted_loading_refuses_the_same_files_with_the_same_messages(tmp_path: Path) -> None:
    """Trust (``weights_only=False``) also reads a legacy (pre-zip) torch file; every other file that is not a torch
    archive gets the message it gets untrusted."""
    from lightning_parallel.checkpoint.errors import CheckpointFormatError
    from lightning_parallel.checkpoint.formats.common import load_torch_file

    (tmp_path / "random.ckpt").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "empty.ckpt").write_bytes(b"")
    for trusted in (False, True):
        with pytest.raises(CheckpointFormatError, match=r"not a checkpoint: torch\.save writes a zip archive"):
            load_torch_file(tmp_path / "random.ckpt", trusted=trusted)
        with pytest.raises(CheckpointFormatError, match="0 bytes"):
            load_torch_file(tmp_path / "empty.ckpt", trusted=trusted)
    legacy = tmp_path / "legacy.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, legacy, _use_new_zipfile_serialization=False)
    assert torch.equal(load_torch_file(legacy, trusted=True)["state_dict"]["w"], torch.ones(2))
    with pytest.raises(CheckpointFormatError, match="not a checkpoint"):
        load_torch_file(legacy, trusted=False)
