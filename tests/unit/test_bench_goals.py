"""The benchmark's per-step overhead goals table, from rows of a run (no run: the rows are written here)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from _bench.report import goals_table, lightning_loop_ms  # noqa: E402


def _row(case: str, role: str, reps_ms: list[float], **extra: Any) -> dict[str, Any]:
    return {"case": case, "key": case, "dp": 2, "role": role, "step_s_reps": [x / 1e3 for x in reps_ms], **extra}


def test_loop_cost_is_lightning_ddp_minus_torch_ddp_per_repetition() -> None:
    rows = [_row("ddp", "torch", [10.0, 12.0, 11.0]), _row("ddp", "lightning", [17.0, 18.0, 19.0])]
    assert lightning_loop_ms(rows) == pytest.approx([7.0, 6.0, 8.0])
    assert lightning_loop_ms(rows[:1]) == []  # no Lightning ddp: no loop cost, and no goals table
    assert goals_table(rows[:1]) == ""


def test_goals_pair_each_repetition_and_mark_the_misses() -> None:
    rows = [
        _row("ddp", "torch", [10.0, 10.0, 10.0]),
        _row("ddp", "lightning", [17.0, 17.0, 17.0]),
        _row("ddp", "ours", [17.5, 17.0, 17.2], x_lightning=1.012),
        _row("pp", "torch", [20.0, 20.0, 20.0]),
        _row("pp", "ours", [30.0, 29.0, 31.0]),  # 30 / (20 + 7) = 1.11: over the 1.05 goal
    ]
    for row, cpu in zip(rows[:3], ([9.0] * 3, [13.0] * 3, [14.0, 14.0, 15.0]), strict=True):
        row["cpu_s_reps"] = [x / 1e3 for x in cpu]
    text = goals_table(rows)
    assert "**7.0 ms** by the wall clock" in text and "**4.0 ms** of CPU time" in text
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert lines["ddp"].count("1.012 yes") == 2  # 17.2 / (10 + 7), the paired median; and x Lightning
    assert lines["ddp"].endswith("| 14.0 | 13.0 | 1.077 **no** | +1.0 | - |")  # CPU: 14 / (9 + 4)
    assert "1.111 **no**" in lines["pp"] and "+3.0" in lines["pp"]  # own ms: 30 - 20 - 7
    assert lines["pp"].endswith("| - |")  # no Lightning built-in


def test_each_case_is_compared_with_the_loop_cost_on_as_many_ranks() -> None:
    """On 2 cores Lightning's loop costs more wall time per step at 4 ranks than at 2 (the ranks take turns on the
    cores): a 4-rank case is held to the cost measured on 4 ranks when the run has it, else to the 2-rank one, and
    the table says which cases borrowed it."""
    rows = [
        _row("ddp", "torch", [10.0, 10.0, 10.0]),
        _row("ddp", "lightning", [12.0, 12.0, 12.0]),
        _row("ddp-dp4", "torch", [20.0, 20.0, 20.0], key="ddp", dp=4),
        _row("ddp-dp4", "lightning", [26.0, 26.0, 26.0], key="ddp", dp=4),
        _row("tp2d", "torch", [100.0, 100.0, 100.0], dp=2, world=4),
        _row("tp2d", "ours", [105.0, 105.0, 105.0], dp=2, world=4),
        _row("hybrid", "torch", [200.0, 200.0, 200.0], dp=2, world=8),
        _row("hybrid", "ours", [204.0, 204.0, 204.0], dp=2, world=8),
    ]
    for row in rows:
        row["cpu_s_reps"] = row["step_s_reps"]
    assert lightning_loop_ms(rows, world=4) == pytest.approx([6.0, 6.0, 6.0])
    text = goals_table(rows)
    assert "on 4 ranks **6.0 ms** by the wall clock" in text
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 106.0 | 0.991 yes | -1.0 |" in lines["tp2d"]  # 105 / (100 + 6), not 105 / (100 + 2)
    assert "| 202.0 | 1.010 yes | +2.0 |" in lines["hybrid"]  # no ddp on 8 ranks: the 2-rank cost
    assert "no `ddp` on as many ranks in this run): hybrid (8 ranks)" in text
    # a run written before rows kept their world size: taken from the case at the row's dp size
    old = [{k: v for k, v in r.items() if k != "world"} | {"key": r["case"].split("-")[0]} for r in rows[4:6]]
    assert "| 106.0 |" in goals_table(rows[:4] + old)


def test_the_run_adds_ddp_at_the_other_world_sizes_only_when_the_loop_cost_is_measured() -> None:
    from _bench.cases import expand, loop_cases

    cases = expand(["dp", "ddp", "tp", "tp2d", "hsdp", "hybrid"], [2])
    added = loop_cases(cases, ["ours", "torch", "lightning"])
    assert [(c.name, c.world, c.loop_cost) for c in added] == [("ddp-dp4", 4, True), ("ddp-dp8", 8, True)]
    assert loop_cases(cases, ["ours", "torch"]) == []  # no Lightning ddp: no loop cost to measure
    assert loop_cases(expand(["tp2d"], [2]), ["ours", "torch", "lightning"]) == []  # no ddp in the run
    assert loop_cases(expand(["ddp", "tp2d"], [2, 4]), ["ours", "torch", "lightning"]) == []  # --dp 2,4 has it
