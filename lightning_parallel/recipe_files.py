"""Recipe files: composing a recipe from the fragments it names, and expanding ``--config`` arguments for the CLI.

A recipe names the fragments of ``configs/`` it builds on, then overrides them. A recipe (or fragment) may start
with a ``defaults`` list; each entry is either a path (merged at the top level) or ``{key: path}`` (merged under
``key``, e.g. ``trainer: ../configs/trainer/cpu_quick.yaml``). Paths are relative to the file that names them;
fragments may have ``defaults`` of their own. Later entries override earlier ones and the recipe's own keys override
them all. OmegaConf interpolations (``${model.init_args.block_size}``) are kept and resolved by the CLI on the
complete composed file (command-line overrides come after). :func:`written_batch_limits` reads back the
``limit_*_batches`` values as written, so that ``1`` stays one batch (``docs/limits.md``, "LightningCLI reads
integer batch limits as floats").
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_parallel.config import LayoutError

__all__ = ["BATCH_LIMIT_KEYS", "compose_recipe", "expand_config_args", "read_yaml", "remove_temporary_recipes",
           "temporary_recipe", "written_batch_limits"]

BATCH_LIMIT_KEYS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
                    "overfit_batches")


def read_yaml(path: str | Path) -> Any:
    """The YAML file at ``path``; a syntax error becomes a :class:`LayoutError` with the file, line and column."""
    file = Path(path)
    try:
        return yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        context = getattr(err, "context", None)
        detail = f"{problem}" + (f" ({context})" if context else "")
        raise LayoutError(f"recipe {str(file)!r}: YAML syntax error at {where}: {detail}. Fix the file there "
                          "(a missing bracket, quote or colon, or an indentation that does not line up).") from None
    except OSError as err:
        raise LayoutError(f"recipe {str(file)!r} cannot be read: {err.strerror or err}.") from None


def _load(path: Path, seen: tuple[Path, ...]) -> DictConfig:
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise LayoutError(f"recipe defaults form a cycle: {chain}.")
    if not path.is_file():
        where = f" (named in {seen[-1]})" if seen else ""
        raise LayoutError(f"recipe file {str(path)!r}{where} does not exist.")
    if not isinstance(read_yaml(path), dict | None):
        raise LayoutError(f"recipe {str(path)!r} must be a mapping at the top level (trainer:, model:, ...), not a "
                          f"{type(read_yaml(path)).__name__}.")
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
    """Replace every ``--config FILE`` whose file has ``defaults`` by the composed config (a temporary file).

    Command-line overrides of scalar keys the composed config already has (``--model.init_args.block_size 64``)
    are written into it as well, so interpolations that point at them (``${model.init_args.block_size}``) follow.
    """
    overrides = _scalar_overrides(args)
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("--config", "-c") and i + 1 < len(args):
            out += [arg, _expanded(args[i + 1], overrides)]
            i += 2
            continue
        if arg.startswith("--config="):
            arg = "--config=" + _expanded(arg.split("=", 1)[1], overrides)
        out.append(arg)
        i += 1
    return out


def _scalar_overrides(args: list[str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--") or arg.startswith(("--config", "--print")):
            continue
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, value = arg[2:], args[i + 1]
        else:
            continue
        parsed = yaml.safe_load(value)
        if isinstance(parsed, str | int | float | bool):
            found[key] = parsed
    return found


def _expanded(path: str, overrides: dict[str, Any]) -> str:
    p = Path(path)
    if p.suffix not in (".yaml", ".yml") or not p.is_file():
        return path
    content = read_yaml(p)
    if not isinstance(content, dict):
        raise LayoutError(f"recipe {str(p)!r} must be a mapping at the top level (trainer:, model:, ...), not a "
                          f"{type(content).__name__}.")
    if "defaults" not in content:
        return path
    composed = OmegaConf.create(compose_recipe(p))
    for key, value in overrides.items():
        current = OmegaConf.select(composed, key, default=None, throw_on_resolution_failure=False)
        if current is not None and not isinstance(current, DictConfig | ListConfig):
            OmegaConf.update(composed, key, value)
    return temporary_recipe(f"# composed from {p}\n" + OmegaConf.to_yaml(composed), prefix=f"{p.stem}.",
                            suffix=".composed.yaml")


_TEMPORARY: list[str] = []
"""The recipe files this process wrote for the parser (composed ``defaults:``, ``parallel: auto`` rewritten)."""


def temporary_recipe(text: str, *, prefix: str, suffix: str = ".yaml") -> str:
    """Write ``text`` to a temporary recipe file for the CLI's parser; :func:`remove_temporary_recipes` deletes it
    when the command ends (each rank the launcher starts composes its own)."""
    tmp = tempfile.NamedTemporaryFile("w", prefix=prefix, suffix=suffix, delete=False)
    with tmp:
        tmp.write(text)
    _TEMPORARY.append(tmp.name)
    return tmp.name


def remove_temporary_recipes() -> None:
    """Delete the temporary recipe files this process wrote (the command is over: the parser read them)."""
    while _TEMPORARY:
        with contextlib.suppress(OSError):
            os.unlink(_TEMPORARY.pop())


def written_batch_limits(args: list[str]) -> dict[str, int | float]:
    """The ``trainer.limit_*_batches`` / ``overfit_batches`` values as the user wrote them (config files, then the
    command line, last one wins).

    Lightning reads ``1`` as one batch and ``1.0`` as all of them, but Trainer's signature says ``float | int``, so
    the CLI parser turns every integer into a float; the CLI uses this to give integers back their type.
    """
    found: dict[str, int | float] = {}
    pairs: list[tuple[str, str]] = []
    for i, arg in enumerate(args):
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            pairs.append((key, value))
        elif (arg.startswith("--") or arg == "-c") and i + 1 < len(args):
            pairs.append((arg, args[i + 1]))
    for key, value in pairs:
        name = key[len("--trainer."):]
        if key in ("--config", "-c") and Path(value).is_file():
            trainer = (OmegaConf.to_container(OmegaConf.load(value)) or {}).get("trainer")  # type: ignore[union-attr]
            if isinstance(trainer, dict):
                found.update({k: v for k, v in trainer.items() if k in BATCH_LIMIT_KEYS and isinstance(v, int | float)})
        elif key.startswith("--trainer.") and name in BATCH_LIMIT_KEYS:
            try:
                found[name] = int(value)
            except ValueError:
                found.pop(name, None)
    return found
