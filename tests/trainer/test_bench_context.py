"""``benchmarks/bench.py`` for context parallelism: the table's ``cp`` case (lp_ddp cp2 against its CPU anchor, a hand
loop over the library's ring units with no strategy and no Lightning: the same losses, and both send the ring's bytes
and the DDP all-reduce at their formula; the one-device equivalence is ``tests/trainer/test_context_parallel.py``'s)
and ``--study context`` (the
bytes a rank keeps for backward at cp = 1, 2, 4 are the CPU formula at s / cp; cp = 4 trains a longer sequence than
cp = 1 within the same per-rank budget). No time is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer.test_bench import _bench


def test_cp_case_trains_as_its_hand_loop_and_both_send_the_formula(tmp_path: Path) -> None:
    bench = _bench()
    rc = bench.main(["--quick", "--cases", "cp", "--roles", "ours,torch", "--warmup", "1", "--steps", "2", "--reps",
                     "3", "--out", str(tmp_path)])
    assert rc == 0
    rows = {r["role"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    ours, torch_row = rows["ours"], rows["torch"]
    assert "error" not in ours and "error" not in torch_row, (ours.get("error"), torch_row.get("error"))
    assert ours["dloss"] <= 1e-5  # the library's cp2 against the hand loop over the same ring, every step
    assert set(ours["comm_theory"]) == {"cp"}  # dp = 1: the replicas' all-reduce runs over the cp group too
    for row in (ours, torch_row):  # the ring's bytes and DDP's all-reduce; the logged loss is control traffic
        assert row["comm"]["cp"] == pytest.approx(row["comm_theory"]["cp"], rel=1e-6), row["comm"]
    assert ours["states_formula"] <= ours["states_bytes"] <= ours["states_formula"] * (1 + 1e-4)


def test_context_study_measures_one_over_cp_and_a_longer_sequence(tmp_path: Path) -> None:
    bench = _bench()
    rc = bench.main(["--study", "context", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "256",
                     "--budget-mib", "1", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "context.json").read_text())
    rows = {r["cp"]: r for r in data["rows"]}
    assert set(rows) == {1, 2, 4}
    for cp, r in rows.items():
        assert r["tokens_per_rank"] == 256 // cp
        assert r["block"] == r["block_cpu_formula"], r  # ring attention keeps what the fused kernel keeps, per rank
        assert r["rank_spread"] == 0  # head-tail chunks: every rank keeps the same bytes
        assert r["step_vs_cp1"] == pytest.approx(1 / cp, rel=0.01)
    longest = {int(k): v["longest"] for k, v in data["search"].items()}
    assert longest[4] >= 3 * longest[1] > 0
