"""bench.py --predict: the planner's step of every benchmark case, and the table with fake measurements."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _bench.cases import CASES, expand  # noqa: E402
from _bench.cli import parse_args  # noqa: E402
from _bench.predict import predict_case, prediction_table, predictions, rates_here, separated_pairs  # noqa: E402


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


def test_the_orders_the_repetitions_settle_are_checked_against_the_prediction() -> None:
    """A pair is settled only when the repetitions do not overlap; the prediction is held to those pairs' order."""
    reps = {"a": [1.0, 1.2], "b": [1.1, 1.3], "c": [2.0, 2.5], "d": [3.0, 3.1]}
    # a/b overlap (unsettled); a<c, a<d, b<c, b<d, c<d settled; predicted c slower than d: one settled pair wrong
    predicted = {"a": 1.0, "b": 0.9, "c": 3.5, "d": 3.0}
    assert separated_pairs(predicted, reps) == (6, 5, ["c < d"])
    assert separated_pairs({"a": 1.0, "b": 0.9, "c": 2.0, "d": 3.0}, reps) == (6, 5, [])
    assert separated_pairs(predicted, {"a": [1.0], "b": [1.0]}) == (1, 0, [])  # equal: not settled
    measured = {k: sorted(v)[len(v) // 2] for k, v in reps.items()}
    text = prediction_table(predicted, measured, reps=reps)
    assert "Same ranking: no" in text
    assert "5 of 6 pairs; predicted in the measured order: 4 of 5 (not: c < d)." in text
    assert "settle" not in prediction_table(predicted, measured)


def test_render_predicts_again_from_the_calibrations_a_run_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """A ``--predict --calibrate-each`` run's results.json keeps its rates (``start_rates``, ``case_rates``);
    ``--render`` writes the three predicted tables again from them with this checkout's model -- the same figures as
    predicting with those rates directly."""
    import json

    import _bench.report as report
    from _bench.predict import predicted_section

    from lightning_parallel.planner.rates import rates_from_dict

    a = parse_args(["--quick", "--predict", "--calibrate-each", "--cases", "ddp,zero3,tp", "--out", str(tmp_path)])
    start = rates_here(a, 2)
    slow = rates_from_dict({**start.to_dict(), "fsdp_unit_ms": 5.0, "source": "slow"})
    case_rates = {"ddp": start, "zero3": slow, "tp": start}
    rows = [{"case": name, "role": "ours", "step_s": step, "variant": name}
            for name, step in (("ddp", 0.02), ("zero3", 0.05), ("tp", 0.06))]
    text, used = predicted_section(a, rows, case_rates=case_rates, start=start)
    assert used is start and text.count("ratios within [0.8, 1.25]") == 3
    # the runs the bench adds for Lightning's loop cost on more ranks are not cases of the prediction
    loop_row = {"case": "ddp-dp4", "key": "ddp", "dp": 4, "role": "ours", "step_s": 0.03, "variant": "ddp-dp4"}
    assert predicted_section(a, [*rows, loop_row], case_rates=case_rates, start=start)[0] == text
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"args": vars(a), "rows": rows, "header": "h", "skipped": {},
                                "start_rates": start.to_dict(),
                                "case_rates": {k: r.to_dict() for k, r in case_rates.items()}}, default=str))
    monkeypatch.setattr(report, "markdown", lambda a, rows, header, skipped: header)  # the measured table: not here
    monkeypatch.setattr(report, "plots", lambda a, rows, folder: [])
    report.render(path)
    rendered = (tmp_path / "results.md").read_text()
    assert text in rendered and "rendered again with `--render`" in rendered
