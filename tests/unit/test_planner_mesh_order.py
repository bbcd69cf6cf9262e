"""The planner's mesh order: bytes each axis moves between nodes per step (``cost.cross_node_bytes``, every number
worked by hand in the comments), the choice of ``parallel.mesh_order``, and how the report, the JSON and the recipe
show it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lightning_parallel import ParallelConfig, ParallelDims
from lightning_parallel.planner import (
    MODEL_PRESETS,
    ModelSpec,
    TrainingSettings,
    load_profile,
    make_hardware,
    make_plan,
)
from lightning_parallel.planner.cli import main
from lightning_parallel.planner.cost import axis_links, cross_node_bytes, cross_node_bytes_by_order
from lightning_parallel.planner.guide import choose_mesh_order, evaluate
from lightning_parallel.planner.report import format_plan, plan_json

DP_PP_TP, PP_DP_TP = ("dp", "pp", "tp"), ("pp", "dp", "tp")
BYTES = {"dp": 10.0, "pp": 3.0, "tp": 7.0}  # what one rank sends per step on each axis


def _dims(dp: int, pp: int, tp: int, order: tuple[str, str, str] = DP_PP_TP) -> ParallelDims:
    return ParallelDims(dp=dp, pp=pp, tp=tp, world_size=dp * pp * tp, order=order)


# --------------------------------------------------------------------------- the pure arithmetic
def test_dp2_pp2_tp2_on_two_nodes_of_four() -> None:
    # dp-pp-tp: dp groups [0,4] [1,5] [2,6] [3,7] each span 2 nodes -> a ring with 2 edges between nodes:
    # 4 groups x 2 edges x B_dp 10 = 80. pp groups [0,2] [1,3] [4,6] [5,7] and tp groups [0,1] ... inside a node: 0.
    assert cross_node_bytes(_dims(2, 2, 2), gpus_per_node=4, bytes_per_rank=BYTES) == {"dp": 80, "pp": 0, "tp": 0}
    # pp-dp-tp: dp groups [0,2] [1,3] [4,6] [5,7] inside a node: 0; pp groups [0,4] [1,5] [2,6] [3,7]: one boundary
    # each between nodes -> 4 x B_pp 3 = 12.
    got = cross_node_bytes(_dims(2, 2, 2, PP_DP_TP), gpus_per_node=4, bytes_per_rank=BYTES)
    assert got == {"dp": 0, "pp": 12, "tp": 0}


def test_one_node_moves_nothing_between_nodes() -> None:
    for order in (DP_PP_TP, PP_DP_TP):
        got = cross_node_bytes(_dims(2, 2, 2, order), gpus_per_node=8, bytes_per_rank=BYTES)
        assert got == {"dp": 0, "pp": 0, "tp": 0}


def test_a_ring_crosses_once_per_node_it_spans() -> None:
    # dp = 8 on 2 nodes of 4: one ring [0..7], members 0-3 on node 0 and 4-7 on node 1: 2 edges between nodes
    # (3 -> 4 and 7 -> 0), not 8. B_dp = 2 g P (d - 1) / d with g = 2 bytes, P = 1e9: 2 x 2e9 x 7/8 = 3.5e9;
    # cross = 2 x 3.5e9 = 7e9.
    b_dp = 2 * 2 * 1e9 * 7 / 8
    assert cross_node_bytes(_dims(8, 1, 1), gpus_per_node=4, bytes_per_rank={"dp": b_dp})["dp"] == 7e9
    # the same ring on 4 nodes of 2: 4 edges between nodes -> 14e9; on 8 nodes of 1: every edge, 8 x 3.5e9 = 28e9
    assert cross_node_bytes(_dims(8, 1, 1), gpus_per_node=2, bytes_per_rank={"dp": b_dp})["dp"] == 14e9
    assert cross_node_bytes(_dims(8, 1, 1), gpus_per_node=1, bytes_per_rank={"dp": b_dp})["dp"] == 28e9
    # tp = 4 with 2 devices per node (tp larger than a node): 2 groups [0..3] [4..7], each over 2 nodes: 2 x 2 x 7
    assert cross_node_bytes(_dims(2, 1, 4), gpus_per_node=2, bytes_per_rank=BYTES)["tp"] == 28


def test_pipeline_boundaries_and_virtual_stages() -> None:
    # pp = 4 on 2 nodes of 2: one chain [0, 1, 2, 3] on nodes [0, 0, 1, 1]: 1 boundary (1 -> 2) between nodes.
    dims = _dims(1, 4, 1)
    assert cross_node_bytes(dims, gpus_per_node=2, bytes_per_rank=BYTES)["pp"] == 3  # 1 x B_pp 3
    # v = 2 chunks per rank: the chain is walked twice (2 x 1 boundary) and wraps 3 -> 0 once (node 1 -> node 0):
    # (2 x 1 + 1 x 1) x 3 = 9
    assert cross_node_bytes(dims, gpus_per_node=2, bytes_per_rank=BYTES, virtual_stages=2)["pp"] == 9
    # v = 3: (3 x 1 + 2 x 1) x 3 = 15; on one node of 4 nothing crosses whatever v
    assert cross_node_bytes(dims, gpus_per_node=2, bytes_per_rank=BYTES, virtual_stages=3)["pp"] == 15
    assert cross_node_bytes(dims, gpus_per_node=4, bytes_per_rank=BYTES, virtual_stages=3)["pp"] == 0
    # pp = 4 on 4 nodes of 1: 3 boundaries between nodes, 3 x 3 = 9
    assert cross_node_bytes(dims, gpus_per_node=1, bytes_per_rank=BYTES)["pp"] == 9


def test_missing_axes_move_nothing_and_bad_arguments_are_refused() -> None:
    assert cross_node_bytes(_dims(2, 2, 2), gpus_per_node=1, bytes_per_rank={}) == {"dp": 0, "pp": 0, "tp": 0}
    with pytest.raises(ValueError, match="gpus_per_node=0"):
        cross_node_bytes(_dims(2, 1, 1), gpus_per_node=0, bytes_per_rank=BYTES)


def test_gpt3_175b_dp2_pp16_tp4_on_16_nodes_of_8() -> None:
    """The recommended layout of ``plan --model gpt3-175b --nodes 16 --gpus-per-node 8 --inter-node slow``."""
    model = ModelSpec.from_shape(MODEL_PRESETS["gpt3-175b"], name="gpt3-175b")
    training = TrainingSettings()  # bf16-mixed: autocast over fp32 weights (4-byte gradients), 2-byte activations
    hardware = make_hardware(nodes=16, gpus_per_node=8, gpu_memory="80GB", inter_node="slow")
    layout = ParallelConfig(data_parallel_size=2, pipeline_parallel_size=16, tensor_parallel_size=4, zero_stage=1,
                            sequence_parallel=True, num_micro_batches=64)
    # P per rank (the first stage, h = 12288, V = 50304, s = 2048): 6 blocks x (12 h^2 / 4 + 6 h / 4 + 6 h)
    # = 6 x 453,076,992 = 2,718,461,952, plus the embedding V h / 4 + s h = 179,699,712 -> 2,898,161,664.
    assert model.params_per_device(pp=16, tp=4) == 2_898_161_664
    # B_dp = 2 g P (d - 1) / d = 2 x 4 x 2,898,161,664 x 1/2 = 11,592,646,656 per rank (fp32 gradients).
    # B_pp = 2 m r s b h / t (sequence parallel; r = 4: the residual stream a stage sends is fp32 under autocast)
    # = 2 x 64 x 4 x 2048 x 1 x 12288 / 4 = 3,221,225,472 per rank.
    got = cross_node_bytes_by_order(model, training, hardware, layout)
    # dp-pp-tp: strides dp 64, pp 4, tp 1. 64 dp groups [r, r + 64], each over 2 nodes: 64 x 2 x B_dp
    # = 1,483,858,771,968. 8 pp groups of stride 4: two stages per node, 7 boundaries between nodes: 56 x B_pp
    # = 180,388,626,432. tp groups of 4 inside a node: 0.
    assert got["dp-pp-tp"] == {"dp": 1_483_858_771_968, "pp": 180_388_626_432, "tp": 0,
                               "total": 1_664_247_398_400}
    # pp-dp-tp: strides pp 8, dp 4, tp 1. dp groups [r, r + 4] inside a node: 0. 8 pp groups of stride 8: one stage
    # per node, 15 boundaries between nodes: 120 x B_pp = 386,547,056,640.
    assert got["pp-dp-tp"] == {"dp": 0, "pp": 386_547_056_640, "tp": 0, "total": 386_547_056_640}
    # the whole layout as the planner evaluates it: pp-dp-tp chosen, and its estimated step follows the order
    chosen = evaluate(model, training, hardware, layout)
    assert chosen.layout.mesh_order == "pp-dp-tp" and chosen.cross_node_bytes == got
    links = axis_links(chosen.layout, hardware)
    assert (links["dp"], links["pp"], links["tp"]) == ("intra-node nvlink", "inter-node slow", "intra-node nvlink")
    links = axis_links(layout, hardware)  # dp-pp-tp
    assert (links["dp"], links["pp"], links["tp"]) == ("inter-node slow", "inter-node slow", "intra-node nvlink")
    kept = evaluate(model, training, hardware, layout, choose_order=False)
    assert kept.layout.mesh_order == "dp-pp-tp" and kept.cost.step_s > chosen.cost.step_s


# --------------------------------------------------------------------------- the choice
def test_choose_mesh_order() -> None:
    cross = {"dp-pp-tp": {"total": 832.0}, "pp-dp-tp": {"total": 193.0}}
    slow = make_hardware(nodes=2, gpus_per_node=8, gpu_memory="80GB", inter_node="slow")
    assert choose_mesh_order(cross, slow) == "pp-dp-tp"
    assert choose_mesh_order(cross, make_hardware(nodes=2, gpus_per_node=8, gpu_memory="80GB")) == "pp-dp-tp"  # fast
    tie = {"dp-pp-tp": {"total": 5.0}, "pp-dp-tp": {"total": 5.0}}
    assert choose_mesh_order(tie, slow) == "dp-pp-tp"
    assert choose_mesh_order({"dp-pp-tp": {"total": 1.0}, "pp-dp-tp": {"total": 9.0}}, slow) == "dp-pp-tp"
    # pcie inside a node (12e9 B/s), a fast fabric between (12.5e9): crossing costs no more, the default is kept
    pcie = make_hardware(nodes=2, gpus_per_node=8, gpu_memory="80GB", intra_node="pcie", inter_node="fast")
    assert choose_mesh_order(cross, pcie) == "dp-pp-tp"
    assert choose_mesh_order({}, make_hardware(gpus_per_node=8, gpu_memory="80GB")) == "dp-pp-tp"  # one node


def test_one_node_plans_keep_the_default_order_and_show_no_order() -> None:
    plan = make_plan(ModelSpec.from_shape(MODEL_PRESETS["gpt3-6.7b"]), TrainingSettings(),
                     load_profile("dgx-a100-80gb", intra_node="pcie"))
    assert all(c.layout.mesh_order == "dp-pp-tp" and not c.cross_node_bytes for c in plan.candidates)
    text = format_plan(plan)
    assert "order" not in text.split("Recommendation:")[0] and "Bytes between nodes" not in text
    rec = plan_json(plan)["recommendation"]
    assert rec["mesh_order"] == "dp-pp-tp" and rec["cross_node_bytes_per_step"] is None


# --------------------------------------------------------------------------- report, JSON, recipe
ARGV_175B = ["--model", "gpt3-175b", "--nodes", "16", "--gpus-per-node", "8", "--gpu-memory", "80GB",
             "--inter-node", "slow"]


def test_cli_text_shows_the_order_and_both_orders_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(ARGV_175B) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("#  strategy"))
    assert header.split()[:6] == ["#", "strategy", "dp", "pp", "tp", "order"]
    assert "mesh_order=pp-dp-tp)" in out.split("Branch:")[0]
    assert "Mesh order pp-dp-tp: 773.1 GB between nodes per step instead of 4.6 TB with dp-pp-tp" in out
    table = out.split("Bytes between nodes per step", 1)[1].splitlines()
    assert table[1].split() == ["order", "dp", "pp", "tp", "total"]
    assert table[2].split() == ["dp-pp-tp", "4.4", "TB", "154.6", "GB", "0", "B", "4.6", "TB"]
    assert table[3].split() == ["pp-dp-tp", "0", "B", "773.1", "GB", "0", "B", "773.1", "GB", "<-", "chosen"]


def test_cli_json_has_the_order_and_the_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGV_175B, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rec = out["recommendation"]
    assert rec["mesh_order"] == "pp-dp-tp"
    assert rec["cross_node_bytes_per_step"] == {
        "dp-pp-tp": {"dp": 4_431_909_224_448, "pp": 154_618_822_656, "tp": 0, "total": 4_586_528_047_104},
        "pp-dp-tp": {"dp": 0, "pp": 773_094_113_280, "tp": 0, "total": 773_094_113_280},
    }
    assert {c["mesh_order"] for c in out["candidates"]} == {"dp-pp-tp", "pp-dp-tp"}


def test_recipe_writes_the_order_on_several_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.yaml"
    assert main([*ARGV_175B, "--write-recipe", str(path)]) == 0
    text = path.read_text()
    assert yaml.safe_load(text)["parallel"]["mesh_order"] == "pp-dp-tp"
    assert "#   pp-dp-tp: dp 0 B, pp 773.1 GB, tp 0 B; total 773.1 GB <- chosen" in text
    # several nodes, the default order: still written (the recipe says which axis crosses nodes)
    path = tmp_path / "ddp.yaml"
    assert main(["--model", "gpt3-125m", "--nodes", "2", "--gpus-per-node", "8", "--gpu-memory", "24GB",
                 "--write-recipe", str(path)]) == 0
    assert yaml.safe_load(path.read_text())["parallel"]["mesh_order"] == "dp-pp-tp"
    # one node: not written
    path = tmp_path / "one.yaml"
    assert main(["--model", "gpt3-125m", "--gpus-per-node", "8", "--gpu-memory", "24GB",
                 "--write-recipe", str(path)]) == 0
    assert "mesh_order" not in path.read_text()
    capsys.readouterr()
