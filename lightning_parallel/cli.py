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

import atexit
import os
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn

import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

import lightning_parallel  # noqa: F401  (registers the strategies)
from lightning_parallel.callbacks import ResumableDataLoaders, RunSummary
from lightning_parallel.config import LayoutError, ParallelConfig, UserInputError, unknown_key_message
from lightning_parallel.planner.detect import PlannerOptions
from lightning_parallel.recipe_files import (
    compose_recipe,
    expand_config_args,
    read_yaml,
    remove_temporary_recipes,
    temporary_recipe,
    written_batch_limits,
)
from lightning_parallel.strategies.base import LayoutStrategy
from lightning_parallel.strategies.layout import CKPT_KEYWORDS

AUTO_STRATEGY = "lp_auto"
"""The strategy name the CLI resolves with the planner (:mod:`lightning_parallel.auto`)."""

__all__ = ["AUTO_STRATEGY", "LightningParallelCLI", "check_recipe", "entry", "main", "resolve_strategy", "takes_layout"]

_DESCRIPTION = (
    "lightning-parallel: train a LightningModule with DP, DDP, ZeRO (sharded DDP), ZeRO-offload, pipeline, tensor or "
    "hybrid DP x PP x TP parallelism, or let the planner choose (--trainer.strategy lp_auto, --planner.* keys). "
    "Subcommands: fit, validate, test, predict (Lightning's CLI, with a `parallel` layout section), plan (recommend "
    "a layout: `lightning-parallel plan --help`), check (build everything `fit` would, start nothing: "
    "`lightning-parallel check --config RECIPE`) and consolidate (any strategy's checkpoint -> one file for one "
    "device: `lightning-parallel consolidate IN OUT`)."
)

_EPILOG = ("The library's own commands (besides Lightning's fit, validate, test and predict above): "
           "`lightning-parallel plan --help`, `lightning-parallel check --config RECIPE`, "
           "`lightning-parallel consolidate --help`.")


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
    if strategy == AUTO_STRATEGY:
        raise LayoutError("trainer.strategy=lp_auto is resolved by the CLI, which has the module; in a script use "
                          "lightning_parallel.auto.plan_for_module(model, ...).make_strategy().")
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


_CLASS_SECTIONS = {"model": "LightningModule", "data": "LightningDataModule"}


def unknown_class_paths(args: list[str]) -> str | None:
    """The refusal for a ``--model``/``--data`` class (command line or a ``--config`` recipe's ``class_path``) that
    does not import, with the nearest class names of the kind, or None. (jsonargparse's own error lists every type it
    tried and suggests nothing.)"""
    for section, given, where in _class_path_values(args):
        if _importable(given, section):
            continue
        kind = _CLASS_SECTIONS[section]
        near = _nearest_classes(given, section)
        hint = f" Did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
        example = "lightning_parallel.models.GPT" if section == "model" else "lightning_parallel.data.TextDataModule"
        return (f"{where}: {given!r} is not an importable {kind} class.{hint} Fix: the full import path of a "
                f"{kind} subclass (e.g. {example}).")
    return None


def _class_path_values(args: list[str]) -> list[tuple[str, str, str]]:
    found: list[tuple[str, str, str]] = []
    for i, arg in enumerate(args):
        for section in _CLASS_SECTIONS:
            for flag in (f"--{section}", f"--{section}.class_path"):
                value = args[i + 1] if arg == flag and i + 1 < len(args) else (
                    arg.split("=", 1)[1] if arg.startswith(flag + "=") else None)
                if value is not None and not value.startswith(("{", "-")) and not value.endswith((".yaml", ".yml")):
                    found.append((section, value, flag))
        path = args[i + 1] if arg in ("--config", "-c") and i + 1 < len(args) else None
        if path is not None and path.endswith((".yaml", ".yml")):
            try:
                recipe = compose_recipe(path)
            except Exception:  # unreadable: the CLI's own parser reports it
                continue
            for section in _CLASS_SECTIONS:
                node = recipe.get(section) if isinstance(recipe, dict) else None
                value = node.get("class_path") if isinstance(node, dict) else node if isinstance(node, str) else None
                if isinstance(value, str):
                    found.append((section, value, f"{section}.class_path in {path}"))
    return found


def _importable(path: str, section: str) -> bool:
    import importlib

    if "." not in path:  # a bare class name: jsonargparse resolves it among the subclasses imported
        return path in {c.__name__ for c in _known_classes(section)}
    module_name, _, name = path.rpartition(".")
    try:
        return hasattr(importlib.import_module(module_name), name)
    except Exception:
        return False


def _known_classes(section: str) -> list[type]:
    import lightning.pytorch as pl

    import lightning_parallel.data
    import lightning_parallel.models  # noqa: F401  (their classes become known subclasses)

    base = pl.LightningModule if section == "model" else pl.LightningDataModule
    seen: list[type] = []
    todo = list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return [c for c in seen if not c.__name__.startswith("_")]


def _nearest_classes(given: str, section: str) -> list[str]:
    import difflib

    classes = _known_classes(section)
    public = {f"{c.__module__}.{c.__qualname__}": c for c in classes}
    for c in classes:  # the package-level path a class is exported under (lightning_parallel.models.GPT)
        package = c.__module__.rpartition(".")[0]
        if package and getattr(__import__(package, fromlist=["_"]), c.__name__, None) is c:
            public[f"{package}.{c.__name__}"] = c
    names = sorted(public) if "." in given else sorted({c.__name__ for c in classes})
    return difflib.get_close_matches(given, names, n=2, cutoff=0.6)


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
        parser_kwargs.setdefault("epilog", _EPILOG)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(*args, **kwargs)

    @override
    def _parse_ckpt_path(self) -> None:
        """Lightning reads a checkpoint file's hyperparameters into the model's config here (with a bare
        ``torch.load``, and silently over what the user set). Instead: the path is verified first (missing, empty,
        truncated, not a checkpoint, of an unknown format version, failing its checksums: one message each), and the
        model's configured init arguments must agree with the hyperparameters it was saved with -- for every format
        (a file, an lp_sharded, DCP or DeepSpeed folder); a disagreement is refused with both values. With
        ``--resume_weights_only`` the path is taken off ``ckpt_path`` and its weights are loaded in
        :meth:`before_fit`."""
        if not self.config.get("subcommand"):
            return
        section = self.config[self.config.subcommand]
        ckpt_path = section.get("ckpt_path")
        if ckpt_path == "last":
            ckpt_path = section.ckpt_path = _resolve_last(section)
        self._weights_from = None
        if not isinstance(ckpt_path, str) or ckpt_path in CKPT_KEYWORDS or "://" in ckpt_path \
                or ckpt_path.startswith("registry"):
            return
        check_ckpt_against_config(section, ckpt_path)
        if section.get("resume_weights_only"):
            self._weights_from = ckpt_path
            section.ckpt_path = None

    def before_fit(self) -> None:
        """``--resume_weights_only``: the checkpoint's weights (any format, joined into whole tensors) go into the
        module, which must fit them; the optimizer, LR schedulers and step count start fresh. For a strategy without
        the library's checked launchers (``lp_dp``, Lightning's own), the checks those launchers run before any rank
        starts run here (:func:`~lightning_parallel.strategies.layout.preflight`)."""
        from lightning_parallel.strategies.layout import (
            CheckedMultiProcessingLauncher,
            CheckedSubprocessLauncher,
            preflight,
        )

        weights = getattr(self, "_weights_from", None)
        if weights:
            load_weights_only(self.model, weights)
        launcher = getattr(self.trainer.strategy, "_launcher", None)
        if not isinstance(launcher, CheckedSubprocessLauncher | CheckedMultiProcessingLauncher):
            ckpt = self._get(self.config_init, "ckpt_path")
            # as `check` does: the checks read the Trainer's function and module, which fit sets only when it starts
            # (before, they saw no fit and no module and checked next to nothing)
            self.trainer.state.fn = TrainerFn.FITTING
            self.trainer.strategy._lightning_module = self.model
            preflight(self.trainer.strategy, self.trainer, (self.model, None, None, self.datamodule, ckpt))

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(ParallelConfig, "parallel", fail_untyped=False)
        parser.add_class_arguments(PlannerOptions, "planner", fail_untyped=False)
        parser.add_argument("--resume_weights_only", type=bool, default=False,
                            help="with --ckpt_path: load only the checkpoint's weights (any format) and start the "
                                 "optimizer, LR schedulers and step count afresh (e.g. after changing the optimizer)")

    @override
    def instantiate_classes(self) -> None:
        """Lightning's, with a class's refusal of its configured arguments (a ``ValueError``/``TypeError`` from its
        constructor, which jsonargparse wraps in its own message) turned into one line naming the error, not a
        traceback. ``LP_TRACEBACK=1`` keeps the traceback."""
        try:
            super().instantiate_classes()
        except UserInputError:
            raise
        except (ValueError, TypeError) as err:
            if os.environ.get("LP_TRACEBACK"):
                raise
            raise LayoutError(_constructor_error(err)) from None

    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        layout = self._get(self.config_init, "parallel")
        if layout is not None and not isinstance(layout, ParallelConfig):
            layout = ParallelConfig.from_dict(dict(layout))
        config = dict(config)
        _elastic_world(config, layout)
        _check_devices(config)
        for key, value in self._written_limits.items():  # `1` means one batch, `1.0` all: keep what was written
            if isinstance(value, int) and config.get(key) == value:
                config[key] = value
        strategy = config.get("strategy", "auto")
        if strategy == AUTO_STRATEGY:
            strategy, layout, callbacks = self._plan_auto(config, layout, callbacks)
        config["strategy"] = resolve_strategy(strategy, layout)
        existing = list(config.get("callbacks") or []) + list(callbacks)
        if not any(isinstance(c, RunSummary) for c in existing):
            callbacks = [*callbacks, RunSummary()]
        if not any(isinstance(c, ResumableDataLoaders) for c in existing):
            callbacks = [*callbacks, ResumableDataLoaders()]  # exact mid-epoch resume under Lightning's strategies
        return super()._instantiate_trainer(config, callbacks)


    def _plan_auto(self, config: dict[str, Any], layout: ParallelConfig | None,
                   callbacks: list[Callback]) -> tuple[Any, ParallelConfig | None, list[Callback]]:
        """``lp_auto``: plan the instantiated module on the hardware found, print the decision (once, on the
        launching process), and return the chosen strategy (instance, or ``"auto"``), no separate layout, and the
        callbacks with the report that
        compares model-state bytes after training and writes the decision and a recipe without lp_auto."""
        from lightning_parallel.auto import plan_for_module
        from lightning_parallel.callbacks.model_states import ModelStateReport

        keep = {key: getattr(layout, key) for key in _RUN_KEYS
                if layout is not None and getattr(layout, key) is not None}
        if layout is not None and layout.replace(**dict.fromkeys(keep)) != ParallelConfig():
            raise LayoutError(
                f"trainer.strategy=lp_auto chooses the layout itself, but the `parallel` section sets "
                f"{layout.describe()}. Fix: remove the parallel section (except {', '.join(_RUN_KEYS)}, which lp_auto "
                "keeps), or name a strategy (the plan's recipe does)."
            )
        options = PlannerOptions.from_any(self._get(self.config_init, "planner"))
        batch, seq = _data_geometry(self.datamodule, self.model)
        decision = plan_for_module(
            self.model, accelerator=config.get("accelerator", "auto"), devices=config.get("devices", "auto"),
            num_nodes=int(config.get("num_nodes") or 1), precision=config.get("precision"),
            micro_batch_size=batch, seq_len=seq, options=options,
            accumulate_grad_batches=int(config.get("accumulate_grad_batches") or 1),
            global_batch_size=keep.get("global_batch_size"),
        )
        text = decision.text()
        if _launching_process():
            print(text, flush=True)
        recipe = self._auto_recipe(decision, text, keep)
        report = ModelStateReport(decision.predicted_states(),
                                  files={"lp_auto_decision.txt": text + "\n", "lp_auto_recipe.yaml": recipe})
        extra = {"start_method": options.start_method} if options.start_method else {}
        return decision.make_strategy(run_settings=keep, **extra), None, [*callbacks, report]

    def _auto_recipe(self, decision: Any, text: str, keep: dict[str, Any] | None = None) -> str:
        """This run's configuration with the chosen strategy and layout in place of lp_auto and the planner keys."""
        from copy import deepcopy

        cfg = deepcopy(self.config[self.subcommand] if self.subcommand else self.config)
        cfg.trainer.strategy = decision.strategy_name if not keep or decision.strategy_name != "auto" else "lp_ddp"
        section = (decision.parallel_section or ParallelConfig()).replace(**(keep or {}))
        for key, value in section.to_dict().items():
            cfg.parallel[key] = value
        for key, value in vars(PlannerOptions()).items():
            cfg.planner[key] = value
        for key in ("ckpt_path", "weights_only"):  # how to resume belongs to the command line, not to the recipe
            if key in cfg:
                del cfg[key]
        data = yaml.safe_load(self._parser(self.subcommand).dump(cfg, skip_none=False))
        for key, value in self._written_limits.items():  # `8` batches as written, not the parser's 8.0 (a fraction)
            if isinstance(value, int) and isinstance(data.get("trainer"), dict):
                data["trainer"][key] = value
        body = yaml.safe_dump(data, sort_keys=False)
        header = "\n".join(f"# {line}" for line in (
            "written by lp_auto: this run's configuration with the strategy and layout it chose,",
            "so that `lightning-parallel fit --config THIS_FILE` reproduces the run without lp_auto.",
            *text.splitlines()))
        return f"{header}\n{body}"


_RUN_KEYS = ("global_batch_size", "collective_timeout")
"""Keys of the ``parallel`` section that are no layout choice: ``lp_auto`` keeps them in the layout it chooses."""


def _elastic_world(config: dict[str, Any], layout: ParallelConfig | None) -> None:
    """An elastic launch (``torchrun.sh --elastic``, :data:`~lightning_parallel.elastic.ELASTIC_ENV`): the nodes and
    ranks per node are the world torchrun's rendezvous formed for this (re)start, so the layout (``auto`` degrees,
    ``lp_auto``'s plan, ``parallel.global_batch_size``'s accumulation) is resolved again against it."""
    from lightning_parallel.elastic import elastic_requested, elastic_world

    if not elastic_requested():
        return
    world = elastic_world()
    config["num_nodes"], config["devices"] = world.nodes, world.devices_per_node
    if os.environ.get("RANK", "0") == "0":
        note = "" if layout is not None and layout.global_batch_size is not None else (
            "; parallel.global_batch_size is not set, so the global batch follows the data-parallel size")
        print(f"lightning-parallel: elastic {'restart' if world.restart else 'start'}: {world.describe()}{note}",
              flush=True)


def _checkpoint_roots(section: Any) -> list[Path]:
    """Where this run's checkpoints go: ModelCheckpoint dirpaths, the loggers' save_dir, default_root_dir."""
    trainer = section.get("trainer") or {}
    roots: list[str] = []
    for callback in trainer.get("callbacks") or []:
        init = callback.get("init_args") if hasattr(callback, "get") else None
        if init is not None and init.get("dirpath"):
            roots.append(str(init.get("dirpath")))
    loggers = trainer.get("logger")
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        if logger is None or not hasattr(logger, "get"):
            continue
        logger_init: Any = logger.get("init_args")
        if logger_init is not None and logger_init.get("save_dir"):
            roots.append(str(logger_init.get("save_dir")))
    roots.append(str(trainer.get("default_root_dir") or os.getcwd()))
    return list(dict.fromkeys(Path(r) for r in roots))


def _resolve_last(section: Any) -> str | None:
    """``--ckpt_path last``: the newest complete checkpoint under this run's checkpoint folders, across the logger's
    versions (Lightning looks only in the new version's empty folder and starts over). Partial saves (``.partial``,
    ``.old``) are skipped and every candidate is verified; None (start from the beginning) when there is none."""
    from lightning_parallel.checkpoint.formats import CheckpointFormatError, detect_format
    from lightning_parallel.checkpoint.names import OLD_SUFFIX, PARTIAL_SUFFIX
    from lightning_parallel.checkpoint.verify import verify_torch_file

    roots = [r for r in _checkpoint_roots(section) if r.is_dir()]
    found = {p for r in roots for p in r.rglob("*.ckpt")
             if PARTIAL_SUFFIX not in p.name and not p.name.endswith(OLD_SUFFIX)}
    for candidate in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            detect_format(candidate) if candidate.is_dir() else verify_torch_file(candidate)
        except CheckpointFormatError as err:
            if _launching_process():
                print(f"lightning-parallel: --ckpt_path last: skipping {candidate} ({str(err).splitlines()[0]})",
                      flush=True)
            continue
        if _launching_process():
            print(f"lightning-parallel: --ckpt_path last is {candidate} (the newest complete checkpoint under "
                  f"{', '.join(str(r) for r in roots)})", flush=True)
        return str(candidate)
    if _launching_process():
        where = ", ".join(str(r) for r in roots) or "the run's folders"
        print(f"lightning-parallel: --ckpt_path last: no checkpoint under {where}; starting from the beginning",
              flush=True)
    return None


def check_ckpt_against_config(section: Any, ckpt_path: str) -> None:
    """``--ckpt_path`` before anything is built: the path exists and verifies (a folder against its checksums), its
    format version is readable, and the model's configured init arguments equal the hyperparameters it was saved
    with, for every checkpoint format; refused with both values otherwise."""
    from lightning_parallel.checkpoint.resume import TRUST_ENV
    from lightning_parallel.checkpoint.summary import configure_as_saved, hparam_differences, shown, summarize
    from lightning_parallel.checkpoint.verify import verify_folder
    from lightning_parallel.strategies.layout import check_ckpt_path

    check_ckpt_path(None, ckpt_path)  # a missing path: the same refusal the launchers give scripts
    if Path(ckpt_path).is_dir():
        verify_folder(ckpt_path)
    summary = summarize(ckpt_path, trusted=os.environ.get(TRUST_ENV, "") == "1")
    saved = summary.hyper_parameters or {}
    model = section.get("model")
    init = getattr(model, "init_args", None) if model is not None else None
    if not saved or init is None:
        return
    differ = hparam_differences(saved, init, free=getattr(_model_class(model), "resume_free_hparams", ()))
    if differ:
        listing = "; ".join(f"{key}: configured {shown(mine)}, saved {shown(theirs)}" for key, mine, theirs in differ)
        raise LayoutError(
            f"--ckpt_path {ckpt_path} ({summary.info.describe()}) was saved by a model with other hyperparameters "
            f"than the one configured: {listing}. Fix: configure the model as it was saved (e.g. "
            f"{configure_as_saved(differ[0][0], differ[0][2])}), or start a new run without --ckpt_path."
        )


def _model_class(model: Any) -> Any:
    """The configured model's class (``class_path``), or None when it cannot be imported here."""
    path = getattr(model, "class_path", None)
    if not isinstance(path, str) or "." not in path:
        return None
    import importlib

    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name, None)
    except Exception:
        return None


def load_weights_only(module: Any, ckpt_path: str) -> None:
    """``--resume_weights_only``: the weights of ``ckpt_path`` (any format, joined into whole tensors) into
    ``module``, which must hold exactly those tensors with those shapes (refused otherwise, before any rank starts)."""
    import torch

    from lightning_parallel.checkpoint.errors import ResumeError
    from lightning_parallel.checkpoint.read import full_state_dict
    from lightning_parallel.checkpoint.resume import TRUST_ENV
    from lightning_parallel.checkpoint.summary import resume_refusal, summarize

    trusted = os.environ.get(TRUST_ENV, "") == "1"
    why = resume_refusal(summarize(ckpt_path, trusted=trusted), module=module, weights_only=True)
    if why:
        raise ResumeError(why)
    state = full_state_dict(ckpt_path, trusted=trusted)
    meta = any(t.is_meta for t in module.state_dict().values() if isinstance(t, torch.Tensor))
    module.load_state_dict(state, strict=True, assign=meta)
    if _launching_process():
        print(f"lightning-parallel: --resume_weights_only: the weights of {ckpt_path} ({len(state)} tensors) are "
              "loaded; the optimizer, LR schedulers and step count start afresh.", flush=True)


def _constructor_error(err: Exception) -> str:
    """The useful lines of a constructor's refusal: jsonargparse lists one error per type it tried (``- ...``); the
    ones that are not "Expected a <class 'NoneType'>" are the class's own words."""
    lines = [line.strip()[2:] for line in str(err).splitlines() if line.strip().startswith("- ")]
    own = [line for line in lines if not line.startswith("Expected a <class 'NoneType'>")]
    text = "; ".join(own) if own else str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"{text} (building the configured classes; set LP_TRACEBACK=1 to see where)"


def _check_devices(config: dict[str, Any]) -> None:
    """``trainer.devices`` and ``trainer.num_nodes`` before Lightning reads them (its own check is a TypeError)."""
    devices, nodes = config.get("devices", "auto"), config.get("num_nodes", 1)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices != -1 and devices < 1:
        raise LayoutError(f"trainer.devices={devices}: give a positive number of devices per node, -1 (all), 'auto', "
                          "or a list of device indices.")
    if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes < 1:
        raise LayoutError(f"trainer.num_nodes={nodes} must be at least 1.")


def _launching_process() -> bool:
    """True on the process the user started (not a rank Lightning or torchrun re-ran): prints go there once."""
    import os

    return all(os.environ.get(key, "0") == "0" for key in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK"))


def _data_geometry(datamodule: Any, model: Any) -> tuple[int | None, int | None]:
    """(batch size per rank, sequence length) read from the data module (``batch_size``, ``block_size``), the
    sequence length falling back to the model's ``block_size`` hyperparameter."""
    def read(obj: Any, key: str) -> int | None:
        value = getattr(obj, key, None)
        if value is None:
            hp = getattr(obj, "hparams", None)
            value = hp.get(key) if hp is not None and hasattr(hp, "get") else None
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    batch = read(datamodule, "batch_size") if datamodule is not None else None
    seq = (read(datamodule, "block_size") if datamodule is not None else None) or read(model, "block_size")
    return batch, seq


class _CheckCLI(LightningParallelCLI):
    """What ``fit`` builds -- the model (on the meta device: no memory, any size), the data module, the Trainer with
    its strategy and the layout resolved against ``devices x num_nodes`` -- and nothing started."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument("--ckpt_path", type=str | None, default=None,
                            help="the checkpoint `fit --ckpt_path` would resume: checked against the model, its "
                                 "optimizers and LR schedulers, as fit checks it before any rank starts")

    @override
    def instantiate_classes(self) -> None:
        import torch

        from lightning_parallel.strategies.layout import LAUNCH_NOTES_ONLY

        with torch.device("meta"):
            self.config_init = self.parser.instantiate_classes(self.config)
        self.datamodule = self._get(self.config_init, "data")
        self.model = self._get(self.config_init, "model")
        # on the meta device because check builds it so, not the user: fit builds it on a real device
        from lightning_parallel.parallel.pipeline import META_BY_CHECK

        self.model.__dict__[META_BY_CHECK] = True
        LAUNCH_NOTES_ONLY["on"] = True  # a recipe for several nodes is checked where they are not started
        try:
            self.trainer = self.instantiate_trainer()
        finally:
            LAUNCH_NOTES_ONLY["on"] = False


def check_recipe(args: list[str]) -> str:
    """``lightning-parallel check --config RECIPE [overrides]``: the dry run of ``fit``.

    Composes the recipe, parses it like ``fit`` (unknown keys and bad values refused), builds the model on the meta
    device, the data module and the Trainer -- which resolves the layout against ``devices x num_nodes`` -- and checks
    the module against the layout (heads % tp, layers >= pp). Starts no process and allocates no weights. Returns the
    summary line; a bad recipe raises :class:`LayoutError` (or exits through the parser, like ``fit``).
    """
    from lightning_parallel.strategies.layout import preflight

    expanded = expand_config_args(args)
    cli = _CheckCLI(args=expanded, run=False, written_limits=written_batch_limits(expanded))
    strategy = cli.trainer.strategy
    ckpt_path = cli.config.get("ckpt_path")
    if ckpt_path == "last":
        ckpt_path = _resolve_last(cli.config)
    weights_only = bool(cli.config.get("resume_weights_only"))
    if isinstance(ckpt_path, str) and "://" not in ckpt_path:
        check_ckpt_against_config(cli.config, ckpt_path)
    if weights_only and isinstance(ckpt_path, str):
        from lightning_parallel.checkpoint.errors import ResumeError
        from lightning_parallel.checkpoint.summary import resume_refusal, summarize

        why = resume_refusal(summarize(ckpt_path), module=cli.model, weights_only=True)
        if why:
            raise ResumeError(why)
        ckpt_path = None
    cli.trainer.state.fn = TrainerFn.FITTING
    cli.trainer.strategy._lightning_module = cli.model
    preflight(strategy, cli.trainer, (cli.model, None, None, cli.datamodule, ckpt_path))
    from lightning_parallel.callbacks.global_batch import GlobalBatch

    global_batch = next((c for c in cli.trainer.callbacks if isinstance(c, GlobalBatch)),  # type: ignore[attr-defined]
                        None)
    describe = getattr(strategy, "describe", None)
    name = describe() if callable(describe) else type(strategy).__name__
    n_params = sum(p.numel() for p in cli.model.parameters())
    cut = getattr(strategy, "describe_cut", None)
    stages = f" | {cut(cli.model)}" if callable(cut) else ""
    batch = f" | {global_batch.describe()}" if global_batch is not None else ""
    note = getattr(strategy, "launch_note", None)
    launch = (f" | note: started as here, fit would be refused ({note.split(': ', 1)[0]}): launch it with "
              "scripts/launch/torchrun.sh or scripts/launch/slurm.sbatch" if note else "")
    return (
        f"lightning-parallel: recipe OK | strategy {name} | {cli.trainer.num_nodes} node(s) x "
        f"{cli.trainer.num_devices} device(s) ({cli.trainer.strategy.root_device.type}){batch} | model "
        f"{type(cli.model).__name__} with {n_params:,} parameters (built on the meta device){stages} | nothing was "
        f"started{launch}"
    )


def auto_parallel_args(args: list[str]) -> list[str]:
    """``parallel: auto`` (in a ``--config`` file) and ``--parallel auto`` mean ``trainer.strategy: lp_auto``: rewrite
    them so (a temporary copy of the recipe without the ``parallel`` key); a strategy named beside them is refused."""

    out: list[str] = []
    auto = False
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--parallel" and i + 1 < len(args) and args[i + 1] == "auto":
            auto, i = True, i + 2
            continue
        if arg == "--parallel=auto":
            auto, i = True, i + 1
            continue
        path = args[i + 1] if arg in ("--config", "-c") and i + 1 < len(args) else None
        if path is not None and path.endswith((".yaml", ".yml")) and os.path.isfile(path):
            data = read_yaml(path) or {}
            if isinstance(data, dict) and data.get("parallel") == "auto":
                auto = True
                del data["parallel"]
                trainer = data.setdefault("trainer", {}) or {}
                named = trainer.get("strategy")
                if named not in (None, "auto", AUTO_STRATEGY):
                    raise LayoutError(f"{path}: `parallel: auto` lets the planner choose the strategy, but "
                                      f"trainer.strategy is {named!r}. Fix: remove one of the two.")
                trainer["strategy"] = AUTO_STRATEGY
                data["trainer"] = trainer
                name = temporary_recipe(f"# {path} with `parallel: auto` read as trainer.strategy: lp_auto\n"
                                        + yaml.safe_dump(data, sort_keys=False), prefix="auto.")
                out += [arg, name]
                i += 2
                continue
        out.append(arg)
        i += 1
    if auto:
        named = [args[j + 1] for j, a in enumerate(args[:-1]) if a == "--trainer.strategy"]
        named += [a.split("=", 1)[1] for a in args if a.startswith("--trainer.strategy=")]
        if any(n not in ("auto", AUTO_STRATEGY) for n in named):
            raise LayoutError(f"`parallel: auto` lets the planner choose the strategy, but --trainer.strategy "
                              f"{named[-1]} names one. Fix: remove one of the two.")
        out += ["--trainer.strategy", AUTO_STRATEGY]
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lightning-parallel`` command."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    finally:
        remove_temporary_recipes()


def entry() -> NoReturn:
    """The ``lightning-parallel`` command and ``python -m lightning_parallel``: :func:`main`, then the process ends.

    After a run that used ``torch.distributed``, the process ends without the interpreter's finalization: the
    ``atexit`` handlers run (the process group is destroyed there, loggers finish), the streams are flushed, and
    :func:`os._exit` returns the exit code. The finalization that is skipped tears down modules and daemon threads
    while the backend's C++ threads may still be alive; it once aborted a finished run on a loaded machine
    (``terminate called without an active exception``, SIGABRT, after ``Trainer.fit`` had ended and every checkpoint
    had been written), turning a successful run into a failed job. A run that raised keeps Python's normal exit (the
    traceback, exit code 1)."""
    code = main()
    distributed = sys.modules.get("torch.distributed")
    if distributed is None or not (distributed.is_available() and distributed.is_initialized()):
        sys.exit(code)
    atexit._run_exitfuncs()  # Python's own exit path (no public name for it)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(code)


def _main(args: list[str]) -> int:
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
                check_args = auto_parallel_args(expand_config_args(args[1:]))
                refusal = (unknown_parallel_keys(check_args) or check_recipe_parallel(args[1:])
                           or unknown_class_paths(args[1:]))
                if refusal:
                    raise LayoutError(refusal)
                print(check_recipe(check_args), flush=True)
        except UserInputError as err:
            print(f"lightning-parallel: error: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        with warnings.catch_warnings():
            # we pass the (expanded) arguments on purpose; LightningCLI warns when sys.argv has them too
            warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
            expanded = auto_parallel_args(expand_config_args(args))
            refusal = unknown_parallel_keys(expanded) or check_recipe_parallel(args) or unknown_class_paths(args)
            if refusal:
                raise LayoutError(refusal)
            cli = LightningParallelCLI(args=expanded, written_limits=written_batch_limits(expanded))
    except (UserInputError, MisconfigurationException) as err:
        print(f"lightning-parallel: error: {err}", file=sys.stderr)
        return 2
    except _RUN_STOPPED as err:  # the same on every rank: said once, by the process the user started
        if _launching_process():
            print(f"lightning-parallel: error: {err}", file=sys.stderr, flush=True)
        return 1
    del cli
    return 0


def _run_stopped_errors() -> tuple[type[BaseException], ...]:
    from lightning_parallel.callbacks.nonfinite import NonFiniteLossError, NoTrainingStepError
    from lightning_parallel.checkpoint.errors import CheckpointWriteError

    return (NonFiniteLossError, NoTrainingStepError, CheckpointWriteError)


_RUN_STOPPED = _run_stopped_errors()
"""Errors that stop a run on every rank at once with one message (a non-finite loss, a fit that ran no step, a
checkpoint the disk refused): printed as one line, exit code 1, no traceback."""


if __name__ == "__main__":
    sys.exit(main())
