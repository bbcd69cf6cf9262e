"""Pure arithmetic of a pipeline layout: which layers form each stage, which stages each rank runs, and the bubble of
the schedules (their names and rules: :data:`lightning_parallel.config.SCHEDULES`). No process group, no Lightning
import.

A module's :meth:`~lightning_parallel.module_hooks.ParallelModuleMixin.pipeline_layers` is an ordered sequence of
``L`` layers. A pipeline of ``p`` ranks with ``v`` chunks per rank ("virtual stages") cuts it into ``n = p x v``
contiguous stages. Stage ``s`` runs on pipeline rank ``s mod p`` (the looped assignment of Megatron's and torch's
interleaved schedules: rank ``r`` holds stages ``r, r + p, ..., r + (v-1) p``), so activations always flow from
rank ``r`` to ``r + 1`` (and from ``p - 1`` back to ``0`` between chunks).

Bubble (idle fraction of a step, each stage's forward + backward of one micro-batch taking the same time, ``m``
micro-batches): GPipe and 1F1B ``(p-1) / (m + p - 1)``; interleaved 1F1B ``(p-1) / (v m + p - 1)``; 1F1B keeps at most
``p`` micro-batches' activations alive per stage where GPipe keeps ``m``.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_parallel.config import SCHEDULES

__all__ = ["balanced_partition", "bubble_fraction", "stage_ranges", "stages_of_rank"]


def bubble_fraction(schedule: str, *, p: int, m: int, v: int = 1) -> float:
    """The textbook idle fraction of a step: ``(p-1) / (m + p - 1)`` for GPipe/1F1B, ``(p-1) / (v m + p - 1)``
    for the interleaved schedules (zero bubble's is lower still; the interleaved formula is its upper bound)."""
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m, v must be >= 1, got p={p}, m={m}, v={v}.")
    chunks = v if SCHEDULES[schedule].multi_stage else 1
    return (p - 1) / (chunks * m + p - 1)


def balanced_partition(weights: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Cut ``weights`` (e.g. each layer's parameter count) into ``parts`` contiguous non-empty ranges ``[start, stop)``
    whose largest sum is as small as possible (ties: the earliest cut points, so later stages -- which hold fewer
    micro-batches of activations under 1F1B -- are not lighter than needed)."""
    n = len(weights)
    if parts < 1 or parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty stages.")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + int(w))
    inf = float("inf")
    # best[k][i]: smallest possible max-sum when the first i layers form k stages; cut[k][i]: where stage k starts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    ranges: list[tuple[int, int]] = []
    stop = n
    for k in range(parts, 0, -1):
        start = cut[k][stop]
        ranges.append((start, stop))
        stop = start
    return ranges[::-1]


def stage_ranges(num_layers: int, stages: int, *, weights: Sequence[int] | None = None,
                 layers_per_stage: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The ``[start, stop)`` layer range of each of ``stages`` stages: ``layers_per_stage`` as given (checked), else
    balanced by ``weights`` (default: one per layer, i.e. by layer count)."""
    if layers_per_stage is not None:
        counts = [int(c) for c in layers_per_stage]
        bad = [c for c in counts if c < 1]
        if bad:
            raise ValueError(
                f"pipeline_stage_layers={counts}: {bad[0]} is not a positive layer count (every stage holds at least "
                "one layer). Fix: give each stage at least 1 layer, or remove pipeline_stage_layers to balance the "
                "stages by parameter count."
            )
        if len(counts) != stages or sum(counts) != num_layers:
            example = [num_layers // stages + (1 if i < num_layers % stages else 0) for i in range(stages)]
            hint = f" (e.g. {example})" if num_layers >= stages else ""
            raise ValueError(
                f"pipeline_stage_layers={counts} must list {stages} positive layer counts (one per stage) summing to "
                f"the module's {num_layers} pipeline layers; got {len(counts)} counts summing to {sum(counts)}. Fix: "
                f"{stages} counts that add up to {num_layers}{hint}, or remove pipeline_stage_layers to balance the "
                "stages by parameter count."
            )
        out, start = [], 0
        for c in counts:
            out.append((start, start + c))
            start += c
        return out
    return balanced_partition(list(weights) if weights is not None else [1] * num_layers, stages)


def stages_of_rank(pp_rank: int, p: int, v: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` runs, in order: ``pp_rank + c p`` for chunk ``c < v``."""
    if not 0 <= pp_rank < p:
        raise ValueError(f"pp_rank={pp_rank} is outside 0..{p - 1}.")
    return [pp_rank + c * p for c in range(v)]
