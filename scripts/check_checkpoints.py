"""Check ``lightning_parallel.checkpoint`` against every strategy and checkpoint kind, and print one row per case.

Each case trains the tests' tiny GPT 3 steps (2 fork-started CPU ranks; ``lp_dp``: 2 replicas in one process),
validates, saves with ``trainer.save_checkpoint``, then reads the checkpoint back with ``full_state_dict`` (one CPU
process, no process group) and ``consolidate`` + ``GPT.load_from_checkpoint`` on one device (the matrix is
``tests/checkpoint_matrix.py``, shared with ``tests/trainer/test_checkpoint_api.py``). Columns: the detected format,
the tensors read, the max abs difference to the live weights (the trained module) of ``full_state_dict`` and of the
consolidated checkpoint loaded on one device, and the validation loss of the distributed run next to the consolidated
model's on one device, and how far training moved the weights from their initial values (a checkpoint read back as the
initial weights would differ from the live ones by that much). Cases whose optional dependency is missing (fairscale,
DeepSpeed, libaio) are listed as skipped. Exit status 1 if any case fails its checks.

    python scripts/check_checkpoints.py                    # the whole matrix (~1-3 min; DeepSpeed ops build once)
    python scripts/check_checkpoints.py --cases lp_sharded  # the cases whose name contains any of the words
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `tests` is importable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from tests.checkpoint_matrix import CASES, STEPS, CaseResult, ensure_deepspeed_ops, run_case, skip_reason

HEADER = ("| strategy / kind | format detected | tensors | max abs diff full_state_dict vs live | max abs diff "
          "consolidate + load_from_checkpoint vs live | val_loss live | val_loss consolidated (1 device) | trained: "
          "max abs diff live vs initial |")


def _row(r: CaseResult) -> str:
    return (f"| {r.case.name} | {r.format} | {r.tensors} | {r.full_vs_live:.1e} | {r.consolidated_vs_live:.1e} | "
            f"{r.val_live:.6f} | {r.val_consolidated:.6f} | {r.live_vs_initial:.1e} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=[], help="run only cases whose name contains one of these")
    parser.add_argument("--keep", type=Path, default=None, help="write the checkpoints here (default: a temp dir)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cases = [c for c in CASES if not args.cases or any(w in c.name for w in args.cases)]
    root = args.keep or Path(tempfile.mkdtemp(prefix="lp_check_checkpoints_"))
    print(f"tiny GPT, {STEPS} steps, checkpoints under {root}", flush=True)
    rows, failures = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"], 0
    for i, case in enumerate(cases):
        reason = skip_reason(case)
        if reason is not None:
            rows.append(f"| {case.name} | skipped: {reason} | | | | | | |")
            continue
        if case.needs in ("deepspeed", "nvme"):
            ensure_deepspeed_ops(nvme=case.needs == "nvme")
        result = run_case(case, root / f"{i:02d}_{case.name.replace(' ', '_')}")
        ok = (result.format == case.expected_format and result.full_vs_live == 0.0
              and result.consolidated_vs_live == 0.0 and result.keys_match and result.hparams_match
              and abs(result.val_live - result.val_consolidated) < 1e-5 and result.live_vs_initial > 1e-4)
        failures += not ok
        rows.append(_row(result) + ("" if ok else " **FAILED**"))
        print(f"[{case.name}] {result.seconds:.1f} s; {result.summary}", flush=True)
    print("\n" + "\n".join(rows))
    print(f"\n{len(cases)} cases, {failures} failed.")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
