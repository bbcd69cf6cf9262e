"""``benchmarks/bench.py`` end to end on a tiny GPT: the library, the hand-written torch loop and Lightning's built-in
train the same steps (equal losses), and the counters agree with the formulas the table prints next to them.

No time is asserted: the ratios are what the script reports, never what a test checks.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lp_bench_script", ROOT / "benchmarks" / "bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_bench_variants_do_the_same_work_and_match_the_formulas(tmp_path: Path) -> None:
    bench = _bench()
    rc = bench.main(["--quick", "--cases", "ddp,tp", "--warmup", "1", "--steps", "2", "--reps", "3",
                     "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["case"], r["role"]): r for r in data["rows"]}
    assert set(rows) == {(c, role) for c in ("ddp", "tp") for role in ("ours", "torch", "lightning")}
    for (case, role), row in rows.items():
        assert "error" not in row, (case, role, row.get("error"))
        assert len(row["step_s_reps"]) == 3
        assert len(row["losses"]) == 4  # warm-up + timed + the counted step
        if role != "torch":
            assert row["dloss"] <= 1e-5, (case, role, row["dloss"])  # the same training as the hand loop
        theory = row["comm_theory"]
        axis = "dp" if case == "ddp" else "tp"
        assert set(theory) == {axis}
        assert row["comm"][axis] == pytest.approx(theory[axis], rel=1e-6), (case, role, row["comm"], theory)
        if role == "ours":
            # the formula has no room for AdamW's one-element ``step`` counters (4 bytes per parameter tensor)
            assert row["states_formula"] <= row["states_bytes"] <= row["states_formula"] * (1 + 1e-4), (
                case, row["states_detail"], row["states_formula"])
            assert {"x_torch", "x_lightning", "cpu_x_torch", "cpu_x_lightning"} <= set(row)
    assert (tmp_path / "results.md").read_text().count("\n| ") >= 6
    assert (tmp_path / "step_time_ratios.png").stat().st_size > 0
    assert (tmp_path / "memory_per_rank.png").stat().st_size > 0
