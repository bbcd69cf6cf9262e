"""``--predict``: the planner's step time of each case next to the step measured in the same run.

Each case becomes the planner's layout on a machine of ``case.world`` devices (one node) with this machine's rates
(``lightning_parallel.planner.calibrate.rates_for`` of a detected machine: the cached calibration, else the defaults;
``lightning-parallel plan --calibrate`` first for a calibrated prediction). The GPT is the benchmark's (the library's
default: biases, untied head, no dropout), fp32 AdamW, no recomputation; the global batch ``B`` is split as the runs
split it: ``B / dp`` sequences per rank in one step, ``B / (dp m)`` per micro-batch with a pipeline of ``m``.
``lp_dp`` (one process driving N replicas with threads) is no planner layout: no prediction.

The table: case, predicted and measured step (ms), their ratio, and the ranking of the cases by predicted and by
measured step (the cases of one table train the same global batch, so the faster step is the faster layout). Two
layouts whose steps differ by less than the machine's noise may come out in either order from one run to the next; so
the table also says which orders the run's repetitions settle (every repetition of one case faster than every
repetition of the other) and whether the prediction keeps every one of them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from _bench.cases import Case, expand

__all__ = ["predict_case", "predicted_section", "prediction_table", "predictions", "rates_here", "separated_pairs"]


def rates_here(a: argparse.Namespace, world: int) -> Any:
    """This machine's rates for ``world`` ranks: the cached calibration, else the defaults
    (``LIGHTNING_PARALLEL_CALIBRATION=none``, as the tests set it: the defaults even with a calibration cached)."""
    from lightning_parallel.planner.calibrate import calibration_mode, rates_for
    from lightning_parallel.planner.hardware import make_hardware

    hardware = make_hardware(gpus_per_node=max(world, 1), gpu_memory="1TB", name="detected",
                             accelerator="cpu" if a.device == "cpu" else "gpu",
                             peak_tflops=0.2 if a.device == "cpu" else 100.0)
    mode = calibration_mode()
    return rates_for(hardware, calibration="cached" if mode == "now" else mode)


def predict_case(a: argparse.Namespace, case: Case, rates: Any) -> Any:
    """The planner's :class:`~lightning_parallel.planner.cost.StepCost` of ``case`` (None for lp_dp)."""
    from _bench.timing import batches_per_step
    from lightning_parallel.config import ParallelConfig
    from lightning_parallel.planner.cost import estimate_step
    from lightning_parallel.planner.hardware import make_hardware
    from lightning_parallel.planner.model import ModelShape, ModelSpec
    from lightning_parallel.planner.settings import TrainingSettings

    if case.key == "dp":
        return None
    shape = ModelShape(n_layer=a.layers, n_embd=a.hidden, n_head=a.heads, vocab_size=a.vocab, block_size=a.seq)
    dp = case.dp
    m = a.micro_batches if case.pp > 1 else 1
    micro = max(1, a.batch // (dp * m))
    training = TrainingSettings(precision="fp32", micro_batch_size=micro, seq_len=a.seq,
                                activation_checkpointing="none", num_micro_batches=m if case.pp > 1 else None,
                                accumulate_grad_batches=batches_per_step(a))
    layout = ParallelConfig.from_dict({
        "data_parallel_size": dp, "pipeline_parallel_size": case.pp, "tensor_parallel_size": case.tp,
        "zero_stage": case.zero, "offload": case.offload, "context_parallel_size": case.cp,
        "activation_checkpointing": "none",
        **({"num_micro_batches": m} if case.pp > 1 else {}),
        **({"data_parallel_shard_size": case.shard} if case.shard else {})})
    hardware = make_hardware(gpus_per_node=case.world, gpu_memory="1TB", rates=rates, name="benchmark",
                             accelerator="cpu" if a.device == "cpu" else "gpu")
    return estimate_step(ModelSpec.from_shape(shape), training, hardware, layout, rates=rates)


def predictions(a: argparse.Namespace, cases: list[Case],
                rates: Callable[[Case], Any] | None = None) -> dict[str, float]:
    """Predicted step seconds of each case that has a planner layout, by case name; ``rates(case)`` gives the rates
    (default: :func:`rates_here` for the case's world)."""
    out: dict[str, float] = {}
    for case in cases:
        cost = predict_case(a, case, rates(case) if rates is not None else rates_here(a, case.world))
        if cost is not None:
            out[case.name] = cost.step_s
    return out


def _ranking(values: dict[str, float]) -> list[str]:
    return [name for name, _ in sorted(values.items(), key=lambda kv: kv[1])]


def separated_pairs(predicted: dict[str, float], reps: dict[str, list[float]]) -> tuple[int, int, list[str]]:
    """The pairs of cases whose repetitions do not overlap (every repetition of one faster than every repetition of
    the other: an order the measurement settles, whatever its noise) and, of those, the ones the prediction puts in
    the other order. Returns (pairs, separated, "a < b" for each separated pair predicted the other way round)."""
    names = [n for n in reps if n in predicted and reps[n]]
    pairs = separated = 0
    wrong: list[str] = []
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            pairs += 1
            fast, slow = (x, y) if max(reps[x]) < min(reps[y]) else (y, x) if max(reps[y]) < min(reps[x]) else ("", "")
            if not fast:
                continue
            separated += 1
            if predicted[fast] >= predicted[slow]:
                wrong.append(f"{fast} < {slow}")
    return pairs, separated, wrong


def prediction_table(predicted: dict[str, float], measured: dict[str, float], *, source: str = "",
                     reps: dict[str, list[float]] | None = None) -> str:
    """Markdown: predicted vs measured step per case, the ratio, and the two rankings (fastest first); with each
    case's repetitions (``reps``), the orders the repetitions settle (:func:`separated_pairs`) and whether the
    prediction keeps them."""
    lines = ["| case | predicted step (ms) | measured step (ms) | predicted / measured |", "|---|---:|---:|---:|"]
    both = [name for name in measured if name in predicted]
    for name in both:
        p, m = predicted[name], measured[name]
        lines.append(f"| {name} | {p * 1e3:,.1f} | {m * 1e3:,.1f} | {p / m:.2f} |")
    for name in measured:
        if name not in predicted:
            lines.append(f"| {name} | no planner layout | {measured[name] * 1e3:,.1f} | - |")
    by_pred = _ranking({n: predicted[n] for n in both})
    by_meas = _ranking({n: measured[n] for n in both})
    ratios = [predicted[n] / measured[n] for n in both]
    inside = sum(0.8 <= r <= 1.25 for r in ratios)
    lines += ["", f"Ranking by predicted step: {' < '.join(by_pred)}",
              f"Ranking by measured step:  {' < '.join(by_meas)}",
              f"Same ranking: {'yes' if by_pred == by_meas else 'no'}; {inside} of {len(ratios)} ratios within "
              "[0.8, 1.25]" + (f"; rates: {source}" if source else "") + "."]
    if reps:
        pairs, separated, wrong = separated_pairs({n: predicted[n] for n in both}, reps)
        lines.append(f"Orders the repetitions settle (no repetition of the slower case as fast as any of the faster): "
                     f"{separated} of {pairs} pairs; predicted in the measured order: {separated - len(wrong)} of "
                     f"{separated}" + (f" (not: {', '.join(wrong)})" if wrong else "") + ".")
    return "\n".join(lines)


def predicted_section(a: argparse.Namespace, rows: list[dict[str, Any]], *, case_rates: dict[str, Any] | None = None,
                      start: Any = None) -> tuple[str, Any]:
    """``--predict``'s section of ``results.md`` and the rates of its first table: the planner's step of each case
    against the library's measured one, with ``start`` (default: :func:`rates_here`, the cached calibration); with
    ``case_rates`` (``--calibrate-each``), also with the rates calibrated just before each case and with their
    median. ``--render`` calls it again on a run's stored rates, so the tables follow the model of the day."""
    asked = {c.name for c in expand(a.cases, a.dp)}  # not the runs added for Lightning's loop cost (ddp-dp4, ...)
    ours = [r for r in rows if r["role"] == "ours" and "step_s" in r and r["case"] in asked]
    measured = {r["case"]: r["step_s"] for r in ours}
    reps = {r["case"]: list(r.get("step_s_reps") or []) for r in ours}
    cases = [c for c in expand(a.cases, a.dp) if c.name in measured]
    rates = start if start is not None else rates_here(a, max((c.world for c in cases), default=1))
    text = "## Predicted against measured\n\n" + prediction_table(predictions(a, cases, lambda case: rates),
                                                                    measured, source=rates.source, reps=reps)
    if case_rates:
        own = [c for c in cases if c.name in case_rates]
        fresh = predictions(a, own, lambda case: case_rates[case.name])
        text += ("\n\n### With a calibration just before each case\n\n"
                 + prediction_table(fresh, measured, source="calibrated before each case (--calibrate-each)",
                                                  reps=reps))
        if len(case_rates) >= 3:  # the calibrations' noise averaged out: the median of every figure
            from lightning_parallel.planner.calibrate import median_rates

            middle = median_rates(list(case_rates.values()))
            central = predictions(a, cases, lambda case: middle)
            text += ("\n\n### With the median of those calibrations\n\n"
                     + prediction_table(central, measured, source=f"the median of {len(case_rates)} calibrations",
                                                      reps=reps))
    return text, rates
