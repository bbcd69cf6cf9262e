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
