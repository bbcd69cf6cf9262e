"""``lp_auto``: the planner chooses the strategy and the layout at launch, from the module and the hardware found.

Before any process starts: the module's parameters and largest layer are counted (``numel`` only, so a module built
on the meta device costs nothing; :func:`~lightning_parallel.planner.detect.model_spec_from_module`), the hardware is
read (:func:`~lightning_parallel.planner.detect.detect_hardware`; ``--planner.*`` keys and profiles override it), the
planner ranks every layout by the decision guide (:func:`~lightning_parallel.planner.make_plan`), and the best layout
that fits *and that this library can run on this module unchanged* is instantiated as its strategy. Passed over, with
the reason printed: layouts that need the largest layer tiled (a model change), offload without DeepSpeed installed,
pipeline or tensor layouts for a module without the ``pipeline_layers`` / ``tensor_parallel_plan`` hooks.

When nothing fits, :class:`NoLayoutFits` (a :class:`~lightning_parallel.config.LayoutError`) gives the numbers, the
nearest layout and the smallest hardware that would fit. After the run :class:`ModelStateReport` compares the
planner's model-state bytes per rank with what the ranks hold.

From the command line: ``lightning-parallel fit --config RECIPE --trainer.strategy lp_auto [--planner.gpu_memory
8MB ...]`` (or ``parallel: auto`` in the recipe). In a script::

    decision = plan_for_module(model, accelerator="cpu", devices=2, precision="32-true", micro_batch_size=16)
    print(decision.text())
    report = ModelStateReport(decision.predicted_states())
    trainer = Trainer(strategy=decision.make_strategy(), accelerator="cpu", devices=2, callbacks=[report])
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from lightning_parallel.config import LayoutError, ParallelConfig
from lightning_parallel.planner.calibrate import rates_for
from lightning_parallel.planner.detect import PlannerOptions, detect_hardware, model_spec_from_module
from lightning_parallel.planner.guide import BRANCH_FAMILIES, NVME_PATH, Candidate
from lightning_parallel.planner.hardware import Hardware
from lightning_parallel.planner.memory import ModelStates, layout_state_bytes, model_states
from lightning_parallel.planner.model import ModelSpec
from lightning_parallel.planner.plan import _BRANCH_TEXT, Plan, _facts, make_plan, mesh_order_sentence
from lightning_parallel.planner.settings import TrainingSettings
from lightning_parallel.planner.units import format_bytes

__all__ = ["AutoDecision", "NoLayoutFits", "PlannerOptions", "choose", "guide_choice", "plan_for_module",
           "runnable_by_speed"]

_MAX_DEVICES = 4096
"""The largest device count the refusal searches for the smallest hardware that fits."""


class NoLayoutFits(LayoutError):
    """No layout this library can run fits the model on the hardware (raised before any process starts)."""


@dataclass(frozen=True)
class AutoDecision:
    """What ``lp_auto`` chose and why: the plan, the chosen and runner-up candidates, what was passed over."""

    plan: Plan
    chosen: Candidate
    runner_up: Candidate | None
    passed_over: list[str] = field(default_factory=list)
    """One line per faster candidate that was not runnable here, with the reason."""
    fastest: list[Candidate] = field(default_factory=list)
    """The runnable candidates that fit, fastest first (the chosen one first)."""
    guide_choice: Candidate | None = None
    """The first runnable candidate in the decision guide's order (what lp_auto chose before it ranked by speed)."""
    select: str = "fastest"
    """How it was chosen: ``fastest`` or ``guide`` (``--planner.select``)."""
    hardware_notes: list[str] = field(default_factory=list)
    model_note: str = ""

    @property
    def layout(self) -> ParallelConfig:
        return self.chosen.layout

    @property
    def strategy_name(self) -> str:
        """The registered strategy that runs the layout; ``auto`` (Lightning's single-device strategy) for one device
        without recomputation, ``lp_ddp`` on one process when activations are recomputed (a layout is needed)."""
        if self.chosen.strategy == "single_device":
            return "auto" if self.layout.activation_checkpointing == "none" else "lp_ddp"
        return self.chosen.strategy

    @property
    def parallel_section(self) -> ParallelConfig | None:
        """The ``parallel`` section to run with (None for Lightning's own single-device strategy)."""
        if self.strategy_name == "auto":
            return None
        if self.chosen.strategy == "single_device":
            return ParallelConfig(activation_checkpointing=self.layout.activation_checkpointing)
        return self.layout

    def _global_batch_text(self) -> str:
        t, dp = self.plan.training, int(self.layout.data_parallel_size)
        a = t.accumulation(dp, self.layout.pipeline_parallel_size)
        if t.global_batch_size is not None:
            return (f"global batch {t.global_batch_size} = batch x dp x accumulation = {t.micro_batch_size} x {dp} x "
                    f"{a} (parallel.global_batch_size: kept whatever the layout)")
        return (f"global batch = batch x dp{' x accumulation' if a > 1 else ''} = {t.micro_batch_size} x {dp}"
                f"{f' x {a}' if a > 1 else ''} (the data module's batch_size is per data-parallel rank: a layout with "
                "a smaller dp trains on a smaller global batch)")

    def predicted_states(self) -> ModelStates:
        """Model-state bytes per rank the planner counts for the chosen layout (busiest pipeline stage)."""
        layout, model = self.layout, self.plan.model
        pp, tp = layout.pipeline_parallel_size, layout.tensor_parallel_size
        dp, cp, shard = int(layout.data_parallel_size), layout.context_parallel_size, layout.data_parallel_shard_size
        n_local = model.params_per_device(pp=pp, tp=tp)
        # at rest (the report measures after each batch's step): sharded over dp x cp, or HSDP's shard groups;
        # FSDP2 (ZeRO-2 in pipelines and under HSDP too) has resharded everything after the step's last backward
        return model_states(n_local, layout_state_bytes(self.plan.training, layout), dp=dp * cp,
                            zero_stage=3 if layout.runs_fsdp2 else layout.zero, offload=layout.offload_device,
                            shard=shard * cp if shard else None)

    def make_strategy(self, run_settings: dict[str, Any] | None = None, **strategy_kwargs: Any) -> Any:
        """The strategy instance (or ``"auto"``) for ``Trainer(strategy=...)``; ``strategy_kwargs`` go to its
        constructor (``start_method="fork"`` and the like). ``run_settings``: layout keys that are no layout choice
        (``global_batch_size``, ``collective_timeout``), kept in the chosen layout (one device then runs
        ``lp_ddp``, which takes a layout, instead of Lightning's own strategy)."""
        from lightning.pytorch.strategies import StrategyRegistry

        import lightning_parallel  # noqa: F401  (registers the strategies)

        name = self.strategy_name
        section = self.parallel_section
        if run_settings:
            section = (section or ParallelConfig()).replace(**run_settings)
            name = "lp_ddp" if name == "auto" else name
        if name == "auto":
            return "auto"
        entry = StrategyRegistry[name]
        return entry["strategy"](parallel=section, **{**entry["init_params"], **strategy_kwargs})

    def describe_candidate(self, candidate: Candidate) -> str:
        mem = candidate.memory
        acts = "activations not counted" if mem.activations is None else f"activations {format_bytes(mem.activations)}"
        host = f"; host {format_bytes(mem.host_per_node)} per node" if mem.host_per_node else ""
        return (f"{candidate.strategy} {candidate.layout.describe()}: {format_bytes(mem.total)} per device of "
                f"{format_bytes(self.plan.hardware.gpu_memory)} (model states {format_bytes(mem.model_states)}, "
                f"{acts}, buffers {format_bytes(mem.buffers)}{host})")

    def text(self) -> str:
        """The decision as printed before training: model, hardware, branch, chosen and runner-up, why."""
        plan = self.plan
        pipelines = plan.training.batch_per_replica and self.chosen.layout.pipeline_parallel_size > 1
        lines = [
            f"lp_auto: model {plan.model.name}: {self.model_note}",
            f"lp_auto: hardware {plan.hardware.describe()}",
            *(f"lp_auto:   {note}" for note in self.hardware_notes),
            f"lp_auto: training {plan.training.precision}, {plan.training.optimizer}, batch "
            f"{plan.training.micro_batch_size} per data-parallel rank"
            f"{' (a pipeline splits it into micro-batches)' if pipelines else ''}, sequence "
            f"{plan.training.sequence_length(_block(plan.model))}; {self._global_batch_text()}",
            f"lp_auto: {_facts_text(plan)}",
            f"lp_auto: guide branch {plan.branch}: {_BRANCH_TEXT[plan.branch]}",
            *(f"lp_auto: passed over {line}" for line in self.passed_over),
            f"lp_auto: chosen    {self.describe_candidate(self.chosen)}"
            f"{mesh_order_sentence(self.chosen, plan.hardware)}",
        ]
        if self.runner_up is not None:
            lines.append(f"lp_auto: runner-up {self.describe_candidate(self.runner_up)}")
        lines.append(f"lp_auto: fastest that fit (predicted; rates: {self.chosen.cost.rates_source or 'defaults'}):")
        for i, c in enumerate(self.fastest[:3] or [self.chosen], 1):
            lines.append(f"lp_auto:   {i}. {_speed_text(c)}")
        why = _why(self)
        lines.append(f"lp_auto: why: {why}")
        predicted = self.predicted_states()
        lines.append(f"lp_auto: predicted model states per rank: {_states_text(predicted)}")
        return "\n".join(lines)


def _facts_text(plan: Plan) -> str:
    """The planner's facts, in lp_auto's words (it has a module, not command-line flags)."""
    return _facts(plan.situation, plan.hardware).replace(
        "the model's shape is unknown (give --model or --layers/--hidden/--heads)", "the module has no GPT shape")


def _block(model: ModelSpec) -> int:
    return model.shape.block_size if model.shape is not None else 0


def _states_text(states: ModelStates) -> str:
    text = (f"{format_bytes(states.device)} on the device (params {format_bytes(states.params)}, grads "
            f"{format_bytes(states.grads)}, optimizer {format_bytes(states.optimizer)})")
    if states.host:
        text += f" + {format_bytes(states.host)} on the host"
    if states.nvme:
        text += f" + {format_bytes(states.nvme)} on NVMe"
    return text


def _speed_text(candidate: Candidate) -> str:
    cost = candidate.cost
    return (f"{candidate.strategy} {candidate.layout.describe()}: step {cost.step_s * 1e3:,.1f} ms, MFU "
            f"{cost.mfu:.1%}, {cost.tokens_per_s:,.0f} tokens/s")


def _why(decision: AutoDecision) -> str:
    chosen, plan = decision.chosen, decision.plan
    families = BRANCH_FAMILIES[plan.branch]
    if decision.plan is not None and decision.select == "guide":
        return (f"{chosen.strategy} is the first layout in the guide's order for this branch ({', '.join(families)}) "
                "that fits and runs here (--planner.select guide).")
    text = (f"{chosen.strategy} {chosen.layout.describe()} has the highest predicted throughput "
            f"({chosen.cost.tokens_per_s:,.0f} tokens/s, step {chosen.cost.step_s * 1e3:,.1f} ms) of the layouts that "
            "fit and run here")
    guide = decision.guide_choice
    if guide is None or guide is chosen or guide.layout == chosen.layout:
        return text + f"; it is also the guide's first choice for this branch ({', '.join(families)})."
    return (text + f"; the guide's order for this branch ({', '.join(families)}) would pick {guide.strategy} "
            f"{guide.layout.describe()}, predicted {guide.cost.tokens_per_s:,.0f} tokens/s (step "
            f"{guide.cost.step_s * 1e3:,.1f} ms; {chosen.cost.tokens_per_s / guide.cost.tokens_per_s:.2f}x slower).")


def _runnable(candidate: Candidate, module: nn.Module | None, options: PlannerOptions) -> str:
    """Empty when lp_auto can run ``candidate`` on ``module`` here, else why not."""
    layout = candidate.layout
    if not candidate.fits:
        return candidate.why_not
    if not candidate.available:
        return f"{candidate.strategy} is not in this version"
    if candidate.tiled_layers:
        return "it needs the largest layer tiled (Memory Centric Tiling), a change to the model lp_auto does not make"
    if layout.offload_device != "none" and importlib.util.find_spec("deepspeed") is None:
        return "offload runs on DeepSpeed, which is not installed (pip install 'lightning-parallel[offload]')"
    if layout.offload_device == "nvme" and not options.nvme_path:
        return "NVMe offload needs --planner.nvme_path"
    if module is not None:
        for size, hook in ((layout.pipeline_parallel_size, "pipeline_layers"),
                           (layout.tensor_parallel_size, "tensor_parallel_plan"),
                           (layout.context_parallel_size, "context_parallel_plan")):
            missing = _missing_hook(module, hook) if size > 1 else None
            if missing:
                return f"{type(module).__name__} {missing}"
    return ""


def _missing_hook(module: nn.Module, hook: str) -> str | None:
    """Why ``module`` cannot run a layout that needs ``hook()`` (None: it can). A ``context_parallel_plan()`` that
    names only the labels of a token-mean loss (the Hugging Face adapter's) routes no attention."""
    fn = getattr(module, hook, None)
    if not callable(fn):
        return f"does not implement {hook}()"
    try:
        value = fn()
    except NotImplementedError:
        return f"does not implement {hook}()"
    if hook == "context_parallel_plan" and not (isinstance(value, Mapping) and "attention" in value):
        if isinstance(value, Mapping) and set(value) <= {"labels", "ignore_index"}:
            return "routes no attention (its context_parallel_plan() names only the labels of its loss)"
        return "has a context_parallel_plan() without 'attention'"
    return None


def _with_nvme_path(candidate: Candidate, options: PlannerOptions) -> Candidate:
    if candidate.layout.nvme_path == NVME_PATH and options.nvme_path:
        return replace(candidate, layout=candidate.layout.replace(nvme_path=options.nvme_path))
    return candidate


def runnable_by_speed(plan: Plan, *, module: nn.Module | None = None,
                      options: PlannerOptions | None = None) -> list[Candidate]:
    """The candidates of ``plan`` that fit and run here, highest predicted throughput (tokens/s) first (ties: the
    plan's order). Throughput, not step time: a layout with a smaller dp runs fewer sequences per step."""
    opts = options or PlannerOptions()
    fitting = [c for c in plan.candidates if c.fits and not _runnable(c, module, opts)]
    order = {id(c): i for i, c in enumerate(fitting)}
    return [_with_nvme_path(c, opts) for c in sorted(fitting, key=lambda c: (1.0 / c.cost.tokens_per_s, order[id(c)]))]


def guide_choice(plan: Plan, *, module: nn.Module | None = None,
                 options: PlannerOptions | None = None) -> Candidate | None:
    """The first candidate in the plan's (the decision guide's) order that fits and runs here."""
    opts = options or PlannerOptions()
    return next((_with_nvme_path(c, opts) for c in plan.candidates if c.fits and not _runnable(c, module, opts)),
                None)


SPEED_TIE = 0.05
"""Predicted throughputs within this share of the best count as equal (the model is good to 10-20 %): among them the
decision guide's order decides."""


def choose(plan: Plan, *, module: nn.Module | None = None,
           options: PlannerOptions | None = None) -> tuple[Candidate | None, Candidate | None, list[str]]:
    """The runnable candidate of ``plan`` with the highest predicted throughput (within :data:`SPEED_TIE` of it, the
    first in the guide's order), a runner-up (the next fastest runnable one, preferring another strategy), and one
    line per faster fitting candidate passed over (not runnable here)."""
    opts = options or PlannerOptions()
    by_speed = runnable_by_speed(plan, module=module, options=opts)
    if not by_speed:
        fitting = [c for c in plan.candidates if c.fits]
        return None, None, [f"{c.strategy} {c.layout.describe()}: {_runnable(c, module, opts)}" for c in fitting[:5]]
    if opts.select not in ("fastest", "guide"):
        raise ValueError(f"--planner.select {opts.select!r}: use fastest or guide.")
    floor = (1 - SPEED_TIE) * by_speed[0].cost.tokens_per_s if opts.select == "fastest" else 0.0
    chosen = next(c for c in by_speed if c.cost.tokens_per_s >= floor and c.layout == _first_near(plan, by_speed,
                                                                                                    floor).layout)
    fitting = [c for c in plan.candidates if c.fits]
    before = (fitting[:next(i for i, c in enumerate(fitting) if c.layout == chosen.layout)] if opts.select == "guide"
              else [c for c in fitting if c.cost.tokens_per_s > chosen.cost.tokens_per_s])
    passed = [f"{c.strategy} {c.layout.describe()}: {why}" for c in before if (why := _runnable(c, module, opts))][:5]
    rest = [c for c in by_speed if c is not chosen]
    others = [c for c in rest if c.strategy != chosen.strategy] or rest
    return chosen, (others[0] if others else None), passed


def _first_near(plan: Plan, by_speed: list[Candidate], floor: float) -> Candidate:
    """Of the runnable candidates at least ``floor`` tokens/s, the first in the plan's (the guide's) order."""
    near = {c.layout for c in by_speed if c.cost.tokens_per_s >= floor}
    return next(c for c in plan.candidates if c.layout in near)


def _settings(*, precision: Any, micro_batch_size: int | None, seq_len: int | None, options: PlannerOptions,
              accumulate_grad_batches: int = 1, global_batch_size: int | None = None) -> TrainingSettings:
    return TrainingSettings(
        precision=str(precision if precision is not None else "32-true"),  # type: ignore[arg-type]
        optimizer=options.optimizer,  # type: ignore[arg-type]
        micro_batch_size=options.micro_batch_size or micro_batch_size or 1,
        # the data module's batch is per dp replica and step: a pipeline splits it (a given micro-batch is one)
        batch_per_replica=None if options.micro_batch_size else micro_batch_size,
        seq_len=options.seq_len or seq_len,
        activation_checkpointing=options.activation_checkpointing,  # type: ignore[arg-type]
        accumulate_grad_batches=accumulate_grad_batches,
        global_batch_size=global_batch_size,
    )


def plan_for_module(
    module: nn.Module,
    *,
    accelerator: Any = "auto",
    devices: Any = "auto",
    num_nodes: int = 1,
    precision: Any = "32-true",
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    options: PlannerOptions | dict[str, Any] | None = None,
    accumulate_grad_batches: int = 1,
    global_batch_size: int | None = None,
) -> AutoDecision:
    """Plan ``module`` on the hardware found (``options`` override it) and choose the layout; refuses with
    :class:`NoLayoutFits` when nothing runnable fits. Bad option values raise :class:`LayoutError` too.
    ``accumulate_grad_batches`` (the Trainer's) or ``global_batch_size`` (the ``parallel`` section's): the
    accumulation the run will do, which keeps ZeRO-2/3's whole gradient until each step's last batch."""
    try:
        opts = PlannerOptions.from_any(options)
        hardware, notes = detect_hardware(accelerator=accelerator, devices=devices, num_nodes=num_nodes, options=opts)
        hardware = _with_rates(hardware, opts, notes)
        spec, how = model_spec_from_module(module)
        training = _settings(precision=precision, micro_batch_size=micro_batch_size, seq_len=seq_len, options=opts,
                             accumulate_grad_batches=accumulate_grad_batches, global_batch_size=global_batch_size)
    except ValueError as err:  # LayoutError included: every refusal says it is lp_auto's
        text = str(err)
        raise LayoutError(text if text.startswith("lp_auto") else f"lp_auto: {text}") from None
    plan = make_plan(spec, training, hardware)
    chosen, runner_up, passed = choose(plan, module=module, options=opts)
    if chosen is None:
        raise NoLayoutFits(refusal(plan, module=module, options=opts, passed=passed))
    return AutoDecision(plan=plan, chosen=chosen, runner_up=runner_up, passed_over=passed, hardware_notes=notes,
                        model_note=how, fastest=runnable_by_speed(plan, module=module, options=opts),
                        guide_choice=guide_choice(plan, module=module, options=opts), select=opts.select)


def _with_rates(hardware: Hardware, options: PlannerOptions, notes: list[str]) -> Hardware:
    """``hardware`` with the rates its step times use (``--planner.calibration``; a profile's own rates stay)."""
    if options.select not in ("fastest", "guide"):
        raise ValueError(f"--planner.select {options.select!r}: use fastest or guide.")
    if hardware.rates is not None:
        notes.append(f"rates from profile {hardware.name!r}")
        return hardware
    if options.calibration not in (None, "cached", "now", "none"):
        raise ValueError(f"--planner.calibration {options.calibration!r}: use cached, now or none.")
    rates = rates_for(hardware, calibration=options.calibration)
    notes.append(f"rates: {rates.source}" + ("" if not rates.source.startswith("defaults") else
                                             " (lightning-parallel plan --calibrate measures this machine)"))
    return replace(hardware, rates=rates)


def _first_runnable(model: ModelSpec, training: TrainingSettings, hardware: Hardware, module: nn.Module | None,
                    options: PlannerOptions) -> Candidate | None:
    plan = make_plan(model, training, hardware)
    return choose(plan, module=module, options=options)[0]


def _round_up(num: int) -> int:
    """Up to two significant digits (a size to quote)."""
    digits = max(0, len(str(num)) - 2)
    return math.ceil(num / 10**digits) * 10**digits


def refusal(plan: Plan, *, module: nn.Module | None, options: PlannerOptions, passed: list[str]) -> str:
    """The message of :class:`NoLayoutFits`: the numbers, the nearest layout, the smallest hardware that fits, and
    fixes that name only what was not already given."""
    hw, model, training = plan.hardware, plan.model, plan.training
    lines = [f"lp_auto: no layout fits {model.name} ({model.n_params:,} parameters) on {hw.describe()}.",
             f"  {_facts_text(plan)}"]
    nearest = min((c for c in plan.candidates if not _runnable(replace(c, fits=True, why_not=""), module, options)),
                  key=lambda c: c.memory.total, default=None)
    if nearest is not None:
        lines.append(f"  Nearest: {nearest.strategy} {nearest.layout.describe()} needs "
                     f"{format_bytes(nearest.memory.total)} per device ({nearest.why_not}).")
    for line in passed:
        lines.append(f"  Fits but cannot run here: {line}.")
    smallest: list[str] = []
    if nearest is not None:
        memory = _round_up(nearest.memory.total)
        for _ in range(8):  # the estimate grows a little with the budget (tiling, buffers): step up until it fits
            found = _first_runnable(model, training, replace(hw, gpu_memory=memory), module, options)
            if found is not None:
                smallest.append(f"{format_bytes(memory)} per device on these {hw.world_size} device(s) "
                                f"({found.strategy} {found.layout.describe()})")
                break
            memory = _round_up(int(memory * 1.1) + 1)
    world = hw.world_size
    nodes = hw.nodes
    while world * 2 <= _MAX_DEVICES:
        world, nodes = world * 2, nodes * 2
        found = _first_runnable(model, training, replace(hw, nodes=nodes), module, options)
        if found is not None:
            smallest.append(f"{world} devices of {format_bytes(hw.gpu_memory)} ({nodes} node(s) x {hw.gpus_per_node}; "
                            f"{found.strategy} {found.layout.describe()})")
            break
    if world > _MAX_DEVICES // 2 and len(smallest) < 2:
        smallest.append(f"no number of {format_bytes(hw.gpu_memory)} devices up to {_MAX_DEVICES} (what each must "
                        "hold -- activations of its micro-batch, its share of the states, the largest layer -- does "
                        "not shrink below that)")
    if smallest:
        lines.append("  Smallest hardware that fits: " + "; ".join(smallest) + ".")
    fixes = []
    if not options.nvme_path:
        nvme = _first_runnable(model, training, replace(hw, nvme=True), module,
                               replace(options, nvme_path=NVME_PATH))
        if nvme is not None:
            fixes.append(f"an NVMe folder (--planner.nvme_path DIR): {nvme.strategy} {nvme.layout.describe()} "
                         "would fit")
    counted = model.shape is not None  # activations are estimated from a GPT shape only
    if counted and options.activation_checkpointing in ("none", "selective"):
        fixes.append("full activation checkpointing (--planner.activation_checkpointing full or auto)")
    if counted and training.micro_batch_size > 1:
        fixes.append(f"a smaller micro-batch (now {training.micro_batch_size}: data.init_args.batch_size)")
    if options.gpu_memory is not None:
        fixes.append(f"a larger --planner.gpu_memory (now {options.gpu_memory}) if the devices have more")
    fixes.append("more devices or nodes (trainer.devices, trainer.num_nodes)")
    lines.append("  Fix: " + "; or ".join(fixes) + ".")
    return "\n".join(lines)
