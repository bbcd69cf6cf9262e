"""Pure arithmetic of pipeline layouts (no process group): stage cuts, rank assignment, bubble formulas, the
schedule rules, and pruning a module to a stage while keeping its parameter names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parallel.config import check_micro_batches
from lightning_parallel.parallel.pipeline import (
    PrunedLayer,
    balanced_partition,
    bubble_fraction,
    plan_stages,
    prune_to,
    stage_ranges,
    stages_of_rank,
)
from tests.helpers import tiny_gpt


def test_balanced_partition_minimizes_the_heaviest_stage() -> None:
    assert balanced_partition([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert balanced_partition([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]  # 5 | 5
    assert balanced_partition([1, 2, 3, 4, 5, 6], 3) == [(0, 3), (3, 5), (5, 6)]  # 6 | 9 | 6 -> max 9
    ranges = balanced_partition([3, 1, 4, 1, 5, 9, 2, 6], 4)
    assert ranges[0][0] == 0 and ranges[-1][1] == 8 and all(a < b for a, b in ranges)
    assert max(sum([3, 1, 4, 1, 5, 9, 2, 6][a:b]) for a, b in ranges) == 9  # the single 9 is the lower bound
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4"):
        balanced_partition([1, 1, 1], 4)


def test_explicit_layer_counts_are_checked() -> None:
    assert stage_ranges(6, 2, layers_per_stage=[2, 4]) == [(0, 2), (2, 6)]
    with pytest.raises(ValueError, match=r"must list 2 positive layer counts .* summing to the module's 6 pipeline "
                                         r"layers; got 2 counts summing to 5"):
        stage_ranges(6, 2, layers_per_stage=[2, 3])


def test_looped_stage_assignment() -> None:
    assert stages_of_rank(0, 2, 1) == [0]
    assert stages_of_rank(1, 4, 2) == [1, 5]
    assert stages_of_rank(3, 4, 3) == [3, 7, 11]


def test_bubble_formulas() -> None:
    assert bubble_fraction("gpipe", p=4, m=4) == pytest.approx(3 / 7)
    assert bubble_fraction("1f1b", p=4, m=12) == pytest.approx(3 / 15)
    assert bubble_fraction("interleaved_1f1b", p=4, m=4, v=2) == pytest.approx(3 / 11)
    assert bubble_fraction("1f1b", p=1, m=8) == 0.0


def test_interleaved_rounds_rule() -> None:
    assert check_micro_batches("interleaved_1f1b", p=4, m=8) is None
    assert check_micro_batches("interleaved_1f1b", p=4, m=3) is None  # one round
    why = check_micro_batches("interleaved_1f1b", p=2, m=7)
    assert why is not None and "7 % 3 = 1" in why
    assert check_micro_batches("1f1b", p=2, m=7) is None


def test_pruning_keeps_the_whole_models_names() -> None:
    model = tiny_gpt(0, n_layer=4)
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    plans = [plan_stages(model, model.pipeline_layers(), pp=2, chunks=1, pp_rank=r) for r in (0, 1)]
    assert plans[0].ranges == plans[1].ranges and plans[0].num_stages == 2
    names = []
    for plan in plans:
        stage = tiny_gpt(0, n_layer=4)
        chunks = prune_to(stage, plan)
        assert len(chunks) == 1 and chunks[0].names == plan.kept
        for n, p in stage.named_parameters():
            assert torch.equal(p, whole[n])
            names.append(n)
        assert stage.parallel_shape()["n_layer"] == 4  # the whole model's facts, also on a stage
    assert sorted(names) == sorted(whole)  # disjoint stages cover the model


def test_pruning_a_module_list_keeps_sibling_indices() -> None:
    class Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    model = Seq()
    plan = plan_stages(model, list(model.layers), pp=2, chunks=1, pp_rank=1)
    prune_to(model, plan)
    assert isinstance(model.layers[0], PrunedLayer) and isinstance(model.layers[1], PrunedLayer)
    assert sorted(n for n, _ in model.named_parameters()) == ["layers.2.bias", "layers.2.weight", "layers.3.bias",
                                                              "layers.3.weight"]
    with pytest.raises(RuntimeError, match="lives on another pipeline stage"):
        model.layers[0](torch.zeros(4))
