"""Tensor-parallel plans without a process group: names, patterns and styles are checked before anything runs."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_parallel.parallel.tensor import PlanError, expand_plan
from tests.helpers import tiny_gpt


def test_patterns_expand_in_module_order_and_one_star_is_one_component() -> None:
    model = tiny_gpt(0)
    plan = expand_plan(model, {"blocks.*.attn.q_proj": "column", "blocks.*.attn.out_proj": "row", "embed.tok": "vocab"})
    assert list(plan) == ["embed.tok", "blocks.0.attn.q_proj", "blocks.0.attn.out_proj", "blocks.1.attn.q_proj",
                          "blocks.1.attn.out_proj"]
    with pytest.raises(PlanError, match=r"'\*\.q_proj' matches no submodule"):
        expand_plan(model, {"*.q_proj": "column"})  # '*' is one dotted component, not several
    assert expand_plan(model, {"blocks.0.attn.q_proj": ColwiseParallel()})  # a ParallelStyle object is accepted


def test_bad_plans_are_refused_with_the_name() -> None:
    model = tiny_gpt(0)
    with pytest.raises(PlanError, match=r"'blocks\.\*\.attn\.qproj' matches no submodule of GPT"):
        expand_plan(model, {"blocks.*.attn.qproj": "column"})
    with pytest.raises(PlanError, match=r"= 'colum' is not a style"):
        expand_plan(model, {"blocks.0.attn.q_proj": "colum"})
    with pytest.raises(PlanError, match="matched by both"):
        expand_plan(model, {"blocks.0.attn.q_proj": "column", "blocks.*.attn.q_proj": "column"})
    # a pipeline stage without block 1: absent names are skipped when asked
    assert expand_plan(model, {"blocks.9.mlp.fc_in": "column"}, skip_missing=True) == {}


def test_style_needs_the_right_module_type() -> None:
    from lightning_parallel.parallel.tensor import make_style

    with pytest.raises(PlanError, match=r"needs Linear, but blocks\.0\.ln_1 is a LayerNorm"):
        make_style("column", nn.LayerNorm(4), name="blocks.0.ln_1", sequence_parallel=False)
