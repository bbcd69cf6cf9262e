"""Recipe composition: a recipe names the fragments of ``configs/`` it builds on, then overrides them.

A recipe (or fragment) may start with a ``defaults`` list; each entry is either a path (merged at the top level)
or ``{key: path}`` (merged under ``key``, e.g. ``trainer: ../configs/trainer/cpu_quick.yaml``). Paths are relative
to the file that names them; fragments may have ``defaults`` of their own. Later entries override earlier ones and
the recipe's own keys override them all. OmegaConf interpolations (``${model.init_args.block_size}``) are kept and
resolved by the CLI on the complete composed file (command-line overrides come after).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.config import LayoutError

__all__ = ["compose_recipe", "expand_config_args"]


def _load(path: Path, seen: tuple[Path, ...]) -> DictConfig:
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise LayoutError(f"recipe defaults form a cycle: {chain}.")
    if not path.is_file():
        where = f" (named in {seen[-1]})" if seen else ""
        raise LayoutError(f"recipe file {str(path)!r}{where} does not exist.")
    node = OmegaConf.load(path)
    if not isinstance(node, DictConfig):
        raise LayoutError(f"recipe {str(path)!r} must be a mapping at the top level.")
    defaults = node.pop("defaults", None)
    if defaults is None:
        return node
    parts: list[DictConfig] = []
    for entry in OmegaConf.to_container(defaults) or []:  # type: ignore[union-attr]
        if isinstance(entry, str):
            parts.append(_load((path.parent / entry).resolve(), (*seen, path)))
        elif isinstance(entry, dict) and len(entry) == 1:
            key, sub = next(iter(entry.items()))
            parts.append(OmegaConf.create({key: _load((path.parent / sub).resolve(), (*seen, path))}))
        else:
            raise LayoutError(f"{path}: each `defaults` entry is a path or {{key: path}}, got {entry!r}.")
    merged = OmegaConf.merge(*parts, node)
    assert isinstance(merged, DictConfig)
    return merged


def compose_recipe(path: str | Path) -> dict[str, Any]:
    """The recipe at ``path`` with its ``defaults`` merged in (interpolations left unresolved)."""
    composed = _load(Path(path).resolve(), ())
    return OmegaConf.to_container(composed, resolve=False)  # type: ignore[return-value]


def expand_config_args(args: list[str]) -> list[str]:
    """Replace every ``--config FILE`` whose file has ``defaults`` by the composed config (a temporary file)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("--config", "-c") and i + 1 < len(args):
            out += [arg, _expanded(args[i + 1])]
            i += 2
            continue
        if arg.startswith("--config="):
            arg = "--config=" + _expanded(arg.split("=", 1)[1])
        out.append(arg)
        i += 1
    return out


def _expanded(path: str) -> str:
    p = Path(path)
    if p.suffix not in (".yaml", ".yml") or not p.is_file():
        return path
    if "defaults" not in (OmegaConf.load(p) or {}):
        return path
    composed = compose_recipe(p)
    tmp = tempfile.NamedTemporaryFile("w", prefix=f"{p.stem}.", suffix=".composed.yaml", delete=False)
    with tmp:
        tmp.write(f"# composed from {p}\n" + OmegaConf.to_yaml(OmegaConf.create(composed)))
    return tmp.name
