"""Run the quick-start recipe under ``lp_auto`` with several memory budgets and tabulate what each chose.

For each budget: ``lightning-parallel fit --config recipes/quickstart.yaml --trainer.strategy lp_auto
--planner.gpu_memory BUDGET [extra]`` as a real command (ranks started as the CLI starts them), then one row: the
strategy and layout chosen, validation loss first -> last, the planner's model-state bytes per rank against the
measured ones. Finally the refusal for a budget where nothing fits.

    python scripts/check_lp_auto.py                       # the full recipe (300 steps) per budget
    python scripts/check_lp_auto.py --max-steps 60        # shorter
    python scripts/check_lp_auto.py --budget 20MB --budget "12MB --trainer.devices 8 --planner.nodes 2 ..."
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGETS = ["1GB", "20MB", "16MB", "14MB", "12MB"]


def _run(args: list[str], *, cwd: Path, timeout: int) -> tuple[int, str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lightning_parallel", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start


def _find(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    return match.group(1) if match else "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", action="append", help="a budget, optionally followed by more CLI arguments")
    parser.add_argument("--max-steps", type=int, default=None, help="trainer.max_steps (default: the recipe's)")
    parser.add_argument("--refuse", default="5MB", help="a budget where nothing fits ('' to skip)")
    parser.add_argument("--timeout", type=int, default=1800)
    opts = parser.parse_args()
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    rows = []
    with tempfile.TemporaryDirectory(prefix="lp_auto_") as tmp:
        for spec in opts.budget or DEFAULT_BUDGETS:
            budget, *extra = shlex.split(spec)
            args = ["fit", "--config", recipe, "--trainer.strategy", "lp_auto", "--planner.gpu_memory", budget,
                    "--trainer.enable_progress_bar", "false", *extra]
            if opts.max_steps:
                args += ["--trainer.max_steps", str(opts.max_steps)]
            print(f"$ lightning-parallel {shlex.join(args)}", flush=True)
            code, out, wall = _run(args, cwd=Path(tmp), timeout=opts.timeout)
            for line in out.splitlines():
                if line.startswith(("lp_auto: chosen", "lp_auto: model states", "lightning-parallel:")):
                    print(f"  {line}", flush=True)
            if code:
                print(out[-3000:], flush=True)
            rows.append({
                "budget": " ".join([budget, *extra]),
                "rc": code,
                "chosen": _find(r"lp_auto: chosen\s+(\S+ [^:]+):", out),
                "val": _find(r"val_loss (\S+ -> \S+)", out),
                "predicted": _find(r"model states per rank: predicted (\S+ \S+)", out),
                "measured": _find(r"; measured (\S+ \S+) on rank", out),
                "ratio": _find(r"measured/predicted (\S+)", out),
                "wall": f"{wall:.0f} s",
            })
        print("\n| budget per rank | chosen | val_loss first -> last | model states per rank predicted / measured "
              "| ratio | rc | wall |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['budget']} | {r['chosen']} | {r['val']} | {r['predicted']} / {r['measured']} | {r['ratio']} "
                  f"| {r['rc']} | {r['wall']} |")
        if opts.refuse:
            args = ["fit", "--config", recipe, "--trainer.strategy", "lp_auto", "--planner.gpu_memory", opts.refuse]
            print(f"\n$ lightning-parallel {shlex.join(args)}", flush=True)
            code, out, wall = _run(args, cwd=Path(tmp), timeout=opts.timeout)
            print("\n".join(line for line in out.splitlines() if "error" in line or line.startswith("  ")))
            print(f"(exit code {code}, {wall:.1f} s, no process started: "
                  f"{'Initializing distributed' not in out})")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
