"""The layout planner: per-device memory of every parallel layout and a recommendation by the decision guide.

Pure computation, no process group. :func:`make_plan` takes a :class:`ModelSpec`, :class:`TrainingSettings` and
:class:`Hardware`; ``lightning-parallel plan`` (:func:`lightning_parallel.planner.cli.main`) is its command line.
Formulas: :mod:`.memory` (ZeRO paper), :mod:`.activations` (Korthikanti et al. 2022); the guide: :mod:`.guide`.
Step times (:mod:`.cost`, layer work in :mod:`.flops`) run on a :class:`Rates` (:mod:`.rates`): a calibration of this
machine (:func:`calibrate`, ``lightning-parallel plan --calibrate``), a profile's vendor figures, or defaults
(:func:`rates_for`); :mod:`.published` checks them against published throughputs.
On several nodes each layout also gets its mesh order (``parallel.mesh_order``) from the bytes each axis moves between
nodes per step (:func:`.cost.cross_node_bytes`).
"""

from lightning_parallel.planner.activations import activation_bytes, layer_activation_bytes
from lightning_parallel.planner.calibrate import calibrate, rates_for
from lightning_parallel.planner.cost import StepCost, estimate_step
from lightning_parallel.planner.guide import Candidate, enumerate_layouts, evaluate, strategy_name
from lightning_parallel.planner.hardware import Hardware, list_profiles, load_profile, make_hardware
from lightning_parallel.planner.memory import MemoryEstimate, estimate_memory, model_states, model_states_bytes
from lightning_parallel.planner.model import MODEL_PRESETS, ModelShape, ModelSpec, load_recipe
from lightning_parallel.planner.plan import Plan, make_plan
from lightning_parallel.planner.rates import Rates
from lightning_parallel.planner.recipe_writer import recipe_dict, write_recipe
from lightning_parallel.planner.report import format_plan, plan_json
from lightning_parallel.planner.settings import StateBytes, TrainingSettings
from lightning_parallel.planner.units import format_bytes, parse_bytes, parse_count

__all__ = [
    "MODEL_PRESETS",
    "Candidate",
    "Hardware",
    "MemoryEstimate",
    "ModelShape",
    "ModelSpec",
    "Plan",
    "Rates",
    "StateBytes",
    "StepCost",
    "TrainingSettings",
    "activation_bytes",
    "calibrate",
    "enumerate_layouts",
    "estimate_memory",
    "estimate_step",
    "evaluate",
    "format_bytes",
    "format_plan",
    "layer_activation_bytes",
    "list_profiles",
    "load_profile",
    "load_recipe",
    "make_hardware",
    "make_plan",
    "model_states",
    "model_states_bytes",
    "parse_bytes",
    "parse_count",
    "plan_json",
    "rates_for",
    "recipe_dict",
    "strategy_name",
    "write_recipe",
]
