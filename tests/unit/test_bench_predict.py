"""bench.py --predict: the planner's step of every benchmark case, and the table with fake measurements."""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _bench.cases import CASES, expand  # noqa: E402
from _bench.cli import parse_args  # noqa: E402
from _bench.predict import predict_case, prediction_table, predictions, rates_here  # noqa: E402


def test_every_case_but_lp_dp_gets_a_prediction() -> None:
    a = parse_args(["--quick", "--predict"])
    assert a.predict
    cases = expand(list(CASES), a.dp)
    got = predictions(a, cases)
    assert set(got) == {c.name for c in cases} - {"dp"}
    assert all(math.isfinite(v) and v > 0 for v in got.values())
    rates = rates_here(a, 8)
    assert rates.source.startswith("defaults")  # tests never read a calibration
    pp = predict_case(a, CASES["pp"], rates)
    assert pp.comm_s["pp"] > 0 and pp.tokens == a.batch * a.seq  # m micro-batches of B / m: the global batch
    hybrid = predict_case(a, CASES["hybrid"], rates)
    assert {"dp", "pp", "tp"} <= set(hybrid.comm_s)


def test_table_with_fake_measurements() -> None:
    predicted = {"ddp": 0.100, "zero1": 0.110, "tp": 0.200}
    measured = {"dp": 0.090, "ddp": 0.110, "zero1": 0.105, "tp": 0.150}
    text = prediction_table(predicted, measured, source="defaults")
    assert "| ddp | 100.0 | 110.0 | 0.91 |" in text
    assert "| tp | 200.0 | 150.0 | 1.33 |" in text
    assert "| dp | no planner layout | 90.0 | - |" in text
    assert "Ranking by predicted step: ddp < zero1 < tp" in text
    assert "Ranking by measured step:  zero1 < ddp < tp" in text
    assert "Same ranking: no; 2 of 3 ratios within [0.8, 1.25]; rates: defaults." in text
    same = prediction_table({"a": 1.0, "b": 2.0}, {"a": 1.1, "b": 2.2})
    assert "Same ranking: yes; 2 of 2" in same
