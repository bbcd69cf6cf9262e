"""Memory Centric Tiling: a ``nn.Linear`` split into tiles computed one after another (no Lightning import).

The decision guide's "largest layer does not fit" branch (``docs/formulas.md``, "Choosing a strategy").
:class:`TiledLinear` holds an ``out_tiles x in_tiles`` grid of small ``nn.Linear`` submodules; tile ``(o, i)`` maps
input features slice ``i`` to output features slice ``o``, and output slice ``o`` is the sum over ``i`` of its tiles
(plus slice ``o`` of the bias, held by tile ``(o, 0)``). The tiles run sequentially.

What it saves, honestly:

* Under ZeRO-3 (and ZeRO-3 offload), parameters are gathered per *submodule* just before its forward and its
  backward and freed after. A plain ``nn.Linear`` of ``out x in`` weights is gathered whole; tiled, at most one tile
  (``out x in / (out_tiles x in_tiles)`` weights, plus its gradient in backward) is materialized at a time. That is
  what lets a layer larger than the device memory run (DeepSpeed's ``TiledLinear`` serves the same purpose). No
  collective is added: the per-tile all-gather (forward and backward) and reduce-scatter (backward) replace the
  per-layer ones and move the same bytes.
* Activations: none. A linear's backward needs only its input (shared by all tiles; each tile saves a view of it,
  not a copy) and its weight, so tiling neither adds nor removes saved activations, and recomputation
  (checkpointing) would buy nothing. The transient workspace is one tile's partial output; the full output is
  written slice by slice into one preallocated tensor.
* Without ZeRO-3 (plain or DDP training) every tile is resident anyway: the transform then costs some speed (smaller
  matmuls) and saves nothing; it is meant for ``lp_zero3_offload`` / ``lp_zero3_offload_nvme``.

Results equal ``nn.Linear`` up to fp32 summation order (input tiles add partial sums in another order; output-only
tiling is the same dot products).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_parallel.parallel.data_parallel.scatter import split_sizes as balanced_split

__all__ = ["TiledLinear", "split_sizes", "tile_linear_layers", "untile_linear_layers"]


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` features split into ``parts`` non-empty tiles of near-equal sizes (the first ones one larger), as
    ``torch.tensor_split``: the data-parallel scatter's balanced split, with every tile required to be non-empty."""
    if parts < 1 or parts > total:
        raise ValueError(f"cannot split {total} features into {parts} tiles (need 1 <= tiles <= {total}).")
    return balanced_split(total, parts)


class TiledLinear(nn.Module):
    """``y = x W^T + b`` computed tile by tile over an ``out_tiles x in_tiles`` grid of ``nn.Linear`` tiles.

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        out_tiles: splits of the output features (rows of ``W``). in_tiles: splits of the input features.
        device, dtype: of the tiles.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, out_tiles: int = 1,
                 in_tiles: int = 1, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.out_splits = split_sizes(out_features, out_tiles)
        self.in_splits = split_sizes(in_features, in_tiles)
        self.tiles = nn.ModuleList(
            nn.ModuleList(
                nn.Linear(i_size, o_size, bias=bias and i == 0, device=device, dtype=dtype)
                for i, i_size in enumerate(self.in_splits)
            )
            for o_size in self.out_splits
        )

    @property
    def has_bias(self) -> bool:
        return self.tiles[0][0].bias is not None  # type: ignore[index]

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, out_tiles: int = 1, in_tiles: int = 1) -> TiledLinear:
        """A tiled copy of ``linear`` (same values, new parameters)."""
        w = linear.weight
        tiled = cls(linear.in_features, linear.out_features, linear.bias is not None, out_tiles=out_tiles,
                    in_tiles=in_tiles, device=w.device, dtype=w.dtype)
        tiled.load_weight(w.detach(), None if linear.bias is None else linear.bias.detach())
        for p_new in tiled.parameters():
            p_new.requires_grad_(w.requires_grad)
        return tiled

    @torch.no_grad()
    def load_weight(self, weight: Tensor, bias: Tensor | None) -> None:
        """Copy a full ``(out, in)`` weight (and bias) into the tiles."""
        rows = torch.split(weight, self.out_splits, dim=0)
        for o, row in enumerate(rows):
            for i, block in enumerate(torch.split(row, self.in_splits, dim=1)):
                self.tiles[o][i].weight.copy_(block)  # type: ignore[index]
        if bias is not None:
            for o, part in enumerate(torch.split(bias, self.out_splits)):
                self.tiles[o][0].bias.copy_(part)  # type: ignore[index]

    @torch.no_grad()
    def full_weight(self) -> tuple[Tensor, Tensor | None]:
        """The assembled ``(out, in)`` weight and bias (copies)."""
        rows: list[list[nn.Linear]] = [list(row) for row in self.tiles]  # type: ignore[call-overload]
        weight = torch.cat([torch.cat([t.weight for t in row], dim=1) for row in rows], dim=0)
        bias = torch.cat([row[0].bias for row in rows]) if self.has_bias else None  # type: ignore[misc]
        return weight, bias

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` with the same values."""
        weight, bias = self.full_weight()
        linear = nn.Linear(self.in_features, self.out_features, bias=bias is not None, device=weight.device,
                           dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(bias)
        return linear

    def forward(self, x: Tensor) -> Tensor:
        inputs = torch.split(x, self.in_splits, dim=-1) if len(self.in_splits) > 1 else (x,)
        if len(self.out_splits) == 1:
            return self._row(0, inputs)
        out = x.new_empty(*x.shape[:-1], self.out_features)
        start = 0
        for o, size in enumerate(self.out_splits):
            out[..., start:start + size] = self._row(o, inputs)  # one tile row's output alive at a time
            start += size
        return out

    def _row(self, o: int, inputs: Sequence[Tensor]) -> Tensor:
        row = self.tiles[o]
        y = row[0](inputs[0])  # type: ignore[index]
        for i in range(1, len(inputs)):
            y = y + row[i](inputs[i])  # type: ignore[index]
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
                f"tiles={len(self.out_splits)}x{len(self.in_splits)}")


def _tile_grid(tiles: int | tuple[int, int]) -> tuple[int, int]:
    out_tiles, in_tiles = (tiles, 1) if isinstance(tiles, int) else tiles
    if out_tiles < 1 or in_tiles < 1:
        raise ValueError(f"tiles={tiles!r}: tile counts must be >= 1.")
    return out_tiles, in_tiles


def tile_linear_layers(module: nn.Module, *, min_params: int, tiles: int | tuple[int, int] = 2) -> list[str]:
    """Replace, in place, every ``nn.Linear`` with at least ``min_params`` weights by a :class:`TiledLinear`.

    ``tiles`` is ``out_tiles`` or ``(out_tiles, in_tiles)``; a layer with fewer features than tiles gets as many
    tiles as it has features. A linear whose weight is shared with another module (tied embeddings) is left alone:
    tiling would untie it. Already tiled layers are skipped, so the transform is idempotent. Returns the names of
    the replaced layers.
    """
    if min_params < 1:
        raise ValueError(f"min_params={min_params} must be >= 1.")
    out_tiles, in_tiles = _tile_grid(tiles)
    counts: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    inside = tuple(f"{n}." for n, m in module.named_modules() if isinstance(m, TiledLinear))
    replaced: list[str] = []
    for name, child in list(module.named_modules()):
        if type(child) is not nn.Linear or child.weight.numel() < min_params or counts[id(child.weight)] > 1:
            continue
        if name.startswith(inside) if inside else False:  # a tile of an already tiled layer
            continue
        tiled = TiledLinear.from_linear(child, out_tiles=min(out_tiles, child.out_features),
                                        in_tiles=min(in_tiles, child.in_features))
        _set_submodule(module, name, tiled)
        replaced.append(name)
    return replaced


def untile_linear_layers(module: nn.Module) -> list[str]:
    """Replace every :class:`TiledLinear` of ``module`` by an equal ``nn.Linear`` (state-dict keys as before)."""
    replaced = []
    for name, child in list(module.named_modules()):
        if isinstance(child, TiledLinear):
            _set_submodule(module, name, child.to_linear())
            replaced.append(name)
    return replaced


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, new)
