"""Memory Centric Tiling: TiledLinear equals nn.Linear (outputs and gradients), and the transform's rules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parallel.models import GPT
from lightning_parallel.parallel.tiling import TiledLinear, split_sizes, tile_linear_layers, untile_linear_layers

GRIDS = [(1, 1), (4, 1), (1, 3), (4, 3), (7, 5)]


@pytest.mark.parametrize("grid", GRIDS, ids=[f"{o}x{i}" for o, i in GRIDS])
@pytest.mark.parametrize("bias", [True, False])
def test_tiled_linear_equals_linear_outputs_and_gradients(grid: tuple[int, int], bias: bool) -> None:
    """fp32: output tiles are the same dot products; input tiles add partial sums in another order (~1e-7)."""
    torch.manual_seed(0)
    linear = nn.Linear(37, 53, bias=bias)
    tiled = TiledLinear.from_linear(linear, out_tiles=grid[0], in_tiles=grid[1])
    x = torch.randn(3, 5, 37, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = linear(x), tiled(x2)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    y2.backward(grad_out)
    tol = 0.0 if grid[1] == 1 and grid[0] == 1 else 2e-6
    assert y2.shape == y.shape
    assert (y - y2).abs().max() <= tol
    assert (x.grad - x2.grad).abs().max() <= tol
    grad_w = torch.cat([torch.cat([t.weight.grad for t in row], 1) for row in tiled.tiles], 0)
    assert (grad_w - linear.weight.grad).abs().max() <= tol
    if bias:
        grad_b = torch.cat([row[0].bias.grad for row in tiled.tiles])
        assert (grad_b - linear.bias.grad).abs().max() <= tol
        assert all(t.bias is None for row in tiled.tiles for t in row[1:])  # one bias slice per output tile
    w, b = tiled.full_weight()
    assert torch.equal(w, linear.weight) and (b is None or torch.equal(b, linear.bias))


def test_tiles_are_submodules_so_zero3_gathers_one_tile_at_a_time() -> None:
    tiled = TiledLinear(64, 96, out_tiles=3, in_tiles=2)
    sizes = [t.weight.numel() for row in tiled.tiles for t in row]
    assert len(sizes) == 6 and max(sizes) == 32 * 32  # the largest unit gathered is 1/6 of the layer
    assert sum(p.numel() for p in tiled.parameters()) == 64 * 96 + 96


def test_split_sizes_and_bad_grids() -> None:
    assert split_sizes(10, 3) == [4, 3, 3]
    with pytest.raises(ValueError, match="cannot split 3 features into 4 tiles"):
        split_sizes(3, 4)
    with pytest.raises(ValueError, match="tile counts must be >= 1"):
        tile_linear_layers(nn.Linear(4, 4), min_params=1, tiles=(0, 1))
    with pytest.raises(ValueError, match="min_params"):
        tile_linear_layers(nn.Linear(4, 4), min_params=0)


def test_transform_tiles_large_linears_only_skips_tied_and_is_idempotent() -> None:
    torch.manual_seed(0)
    model = GPT(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    reference = GPT(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    reference.load_state_dict(model.state_dict())
    replaced = tile_linear_layers(model, min_params=2048, tiles=(2, 2))
    assert replaced == ["blocks.0.mlp.fc_in", "blocks.0.mlp.fc_out", "blocks.1.mlp.fc_in", "blocks.1.mlp.fc_out",
                        "head.lm_head"]  # 32x128 = 4096 and 64x32 = 2048 weights; attention's 32x32 = 1024 stay
    assert tile_linear_layers(model, min_params=2048, tiles=(2, 2)) == []
    idx = torch.randint(0, 64, (2, 16))
    assert (model(idx) - reference(idx)).abs().max() < 1e-5
    untile_linear_layers(model)
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(),
                                                 strict=True))
    tied = GPT(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64, tie_embeddings=True)
    assert "head.lm_head" not in tile_linear_layers(tied, min_params=2048)  # tiling would untie it
