"""``lightning-parallel``: Lightning's CLI (``fit``/``validate``/``test``/``predict``) plus ``plan``.

``lightning-parallel fit --config recipes/quickstart.yaml`` is LightningCLI with OmegaConf interpolation, any
LightningModule / LightningDataModule by class path (``subclass_mode``), any registered strategy name or strategy
class with its arguments, and a top-level ``parallel`` section (:class:`~lightning_parallel.config.ParallelConfig`)
that is handed to the library's strategies. Layouts are validated against ``trainer.devices x trainer.num_nodes``
when the Trainer is built, before any process is spawned; a bad one ends the command with the arithmetic and the
fix (exit code 2). ``lightning-parallel plan ...`` is the layout planner (``--help`` for its options);
``lightning-parallel consolidate IN OUT`` writes any strategy's checkpoint as one single-device Lightning file.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

import lightning_parallel  # noqa: F401  (registers the strategies)
from lightning_parallel.callbacks import RunSummary
from lightning_parallel.config import LayoutError, ParallelConfig, unknown_key_message
from lightning_parallel.recipe_files import compose_recipe, expand_config_args, written_batch_limits
from lightning_parallel.strategies.base import LayoutStrategy

__all__ = ["LightningParallelCLI", "check_recipe", "main", "resolve_strategy", "takes_layout"]

_DESCRIPTION = (
    "lightning-parallel: train a LightningModule with DP, DDP, ZeRO (sharded DDP), ZeRO-offload or tensor "
    "parallelism (pipeline and hybrid parallelism are planned). Subcommands: fit, validate, test, predict "
    "(Lightning's CLI, with a `parallel` layout section), plan (recommend a layout: `lightning-parallel plan "
    "--help`), check (build everything `fit` would, start nothing: `lightning-parallel check --config RECIPE`) and "
    "consolidate (any strategy's checkpoint -> one file for one device: `lightning-parallel consolidate IN OUT`)."
)


def takes_layout(strategy: Any) -> bool:
    """A strategy (class or instance) that takes a layout: a ``LayoutStrategy``, or any strategy with the same small
    protocol -- a ``parallel=`` argument, a ``layout`` property and ``set_layout()`` (``lp_zero_offload``)."""
    if isinstance(strategy, type):
        return issubclass(strategy, LayoutStrategy) or (
            callable(getattr(strategy, "set_layout", None)) and hasattr(strategy, "layout")
        )
    return isinstance(strategy, LayoutStrategy) or (
        callable(getattr(strategy, "set_layout", None)) and isinstance(getattr(strategy, "layout", None),
                                                                       ParallelConfig)
    )


def resolve_strategy(strategy: Any, layout: ParallelConfig | None) -> Any:
    """Give the ``parallel`` section to the strategy: a registered name becomes an instance with the layout.

    A layout that differs from the default and a strategy that takes none (Lightning's ``ddp``, ``auto``, ...) is
    an error, not a silent no-op.
    """
    default = ParallelConfig()
    custom = layout is not None and layout != default
    if isinstance(strategy, str) and strategy not in StrategyRegistry and strategy != "auto":
        raise LayoutError(unknown_strategy_message(strategy))
    if isinstance(strategy, str) and strategy in StrategyRegistry:
        entry = StrategyRegistry[strategy]
        cls = entry["strategy"]
        if isinstance(cls, type) and takes_layout(cls):
            return cls(parallel=layout, **entry["init_params"])
    elif takes_layout(strategy):
        # the layout the user gave the strategy (presets may have filled in a stage: not "given")
        given = getattr(strategy, "explicit_layout", strategy.layout)
        if custom and given not in (default, layout):
            raise LayoutError(
                f"the layout is given twice and the two differ: the `parallel` section says {layout.describe()} "  # type: ignore[union-attr]
                f"but trainer.strategy.init_args.parallel says {given.describe()}. Fix: keep one."
            )
        if custom:
            strategy.set_layout(layout)  # type: ignore[arg-type]
        return strategy
    if custom:
        name = strategy if isinstance(strategy, str) else type(strategy).__name__
        raise LayoutError(
            f"the `parallel` section sets {layout.describe()}, but trainer.strategy={name!r} does not take a layout. "  # type: ignore[union-attr]
            "Fix: use one of the library's strategies (lp_ddp, ...), or remove the parallel section."
        )
    return strategy


def unknown_strategy_message(name: str) -> str:
    """An unknown ``trainer.strategy`` name: the nearest registered names and the library's own."""
    import difflib

    registered = sorted(StrategyRegistry.available_strategies())
    near = difflib.get_close_matches(name, registered, n=3, cutoff=0.6)
    ours = [n for n in registered if n.startswith("lp_")]
    hint = f" Did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
    return (f"trainer.strategy={name!r} is not a registered strategy.{hint} The library's strategies: "
            f"{', '.join(ours)}; Lightning's own names (ddp, fsdp, ...) and a strategy class path work too.")


def unknown_parallel_keys(args: list[str]) -> str | None:
    """The refusal for ``--parallel.KEY`` arguments whose key is not a layout key (with the nearest valid one), or
    None. (Keys in a recipe's ``parallel`` section are checked the same way by :func:`check_recipe_parallel`.)"""
    valid = ParallelConfig.field_names()
    for arg in args:
        if arg.startswith("--parallel."):
            key = arg[len("--parallel."):].split("=", 1)[0]
            if key not in valid:
                return unknown_key_message(key, where=f"--parallel.{key}")
    return None


def check_recipe_parallel(args: list[str]) -> str | None:
    """The refusal for an unknown key in the ``parallel`` section of a ``--config`` file, or None."""
    valid = ParallelConfig.field_names()
    for i, arg in enumerate(args):
        path = args[i + 1] if arg in ("--config", "-c") and i + 1 < len(args) else (
            arg.split("=", 1)[1] if arg.startswith("--config=") else None)
        if path is None or not path.endswith((".yaml", ".yml")):
            continue
        try:  # the recipe with its `defaults` fragments merged in
            section = compose_recipe(path).get("parallel")
        except Exception:  # unreadable: the CLI's own parser reports it
            continue
        for key in section or {} if isinstance(section, dict) else {}:
            if key not in valid:
                return unknown_key_message(str(key), where=f"parallel.{key} in {path}")
    return None


class LightningParallelCLI(LightningCLI):
    """LightningCLI with the ``parallel`` section, OmegaConf interpolation, subclass mode and a run summary."""

    def __init__(self, *args: Any, written_limits: dict[str, int | float] | None = None, **kwargs: Any) -> None:
        self._written_limits = written_limits or {}
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("auto_configure_optimizers", False)
        parser_kwargs = kwargs.setdefault("parser_kwargs", {})
        parser_kwargs.setdefault("parser_mode", "omegaconf")
        parser_kwargs.setdefault("description", _DESCRIPTION)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(*args, **kwargs)

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(ParallelConfig, "parallel", fail_untyped=False)

    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        layout = self._get(self.config_init, "parallel")
        if layout is not None and not isinstance(layout, ParallelConfig):
            layout = ParallelConfig.from_dict(dict(layout))
        config = dict(config)
        for key, value in self._written_limits.items():  # `1` means one batch, `1.0` all: keep what was written
            if isinstance(value, int) and config.get(key) == value:
                config[key] = value
        config["strategy"] = resolve_strategy(config.get("strategy", "auto"), layout)
        existing = list(config.get("callbacks") or []) + list(callbacks)
        if not any(isinstance(c, RunSummary) for c in existing):
            callbacks = [*callbacks, RunSummary()]
        return super()._instantiate_trainer(config, callbacks)


class _CheckCLI(LightningParallelCLI):
    """What ``fit`` builds -- the model (on the meta device: no memory, any size), the data module, the Trainer with
    its strategy and the layout resolved against ``devices x num_nodes`` -- and nothing started."""

    @override
    def instantiate_classes(self) -> None:
        import torch

        with torch.device("meta"):
            self.config_init = self.parser.instantiate_classes(self.config)
        self.datamodule = self._get(self.config_init, "data")
        self.model = self._get(self.config_init, "model")
        self.trainer = self.instantiate_trainer()


def check_recipe(args: list[str]) -> str:
    """``lightning-parallel check --config RECIPE [overrides]``: the dry run of ``fit``.

    Composes the recipe, parses it like ``fit`` (unknown keys and bad values refused), builds the model on the meta
    device, the data module and the Trainer -- which resolves the layout against ``devices x num_nodes`` -- and checks
    the module against the layout (heads % tp, layers >= pp). Starts no process and allocates no weights. Returns the
    summary line; a bad recipe raises :class:`LayoutError` (or exits through the parser, like ``fit``).
    """
    expanded = expand_config_args(args)
    cli = _CheckCLI(args=expanded, run=False, written_limits=written_batch_limits(expanded))
    strategy = cli.trainer.strategy
    check_module = getattr(strategy, "check_module", None)
    if callable(check_module):
        check_module(cli.model)
    check_data = getattr(strategy, "check_data", None)
    if callable(check_data):
        check_data((cli.datamodule,))
    describe = getattr(strategy, "describe", None)
    name = describe() if callable(describe) else type(strategy).__name__
    n_params = sum(p.numel() for p in cli.model.parameters())
    cut = getattr(strategy, "describe_cut", None)
    stages = f" | {cut(cli.model)}" if callable(cut) else ""
    return (
        f"lightning-parallel: recipe OK | strategy {name} | {cli.trainer.num_nodes} node(s) x "
        f"{cli.trainer.num_devices} device(s) ({cli.trainer.strategy.root_device.type}) | model "
        f"{type(cli.model).__name__} with {n_params:,} parameters (built on the meta device){stages} | nothing was "
        "started"
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lightning-parallel`` command."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "plan":
        from lightning_parallel.planner.cli import main as plan_main

        return plan_main(args[1:])
    if args and args[0] == "consolidate":
        from lightning_parallel.checkpoint import main as consolidate_main

        return consolidate_main(args[1:])
    if args and args[0] == "check":
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
                refusal = unknown_parallel_keys(args[1:]) or check_recipe_parallel(args[1:])
                if refusal:
                    raise LayoutError(refusal)
                print(check_recipe(args[1:]), flush=True)
        except LayoutError as err:
            print(f"lightning-parallel: error: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        with warnings.catch_warnings():
            # we pass the (expanded) arguments on purpose; LightningCLI warns when sys.argv has them too
            warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
            expanded = expand_config_args(args)
            refusal = unknown_parallel_keys(expanded) or check_recipe_parallel(args)
            if refusal:
                raise LayoutError(refusal)
            LightningParallelCLI(args=expanded, written_limits=written_batch_limits(expanded))
    except LayoutError as err:
        print(f"lightning-parallel: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
