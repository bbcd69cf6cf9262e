"""Save under every layout, resume under every other: the matrix of resumed loss and weight difference.

    OMP_NUM_THREADS=1 python scripts/check_resume_matrix.py [--json out.json] [--only "lp_ddp x2" ...]

A small GPT (2 blocks, width 32, vocab 64) trains 6 AdamW steps of one global batch of 8 samples on CPU (forked gloo
ranks); an epoch is 5 steps. Each layout saves at step 3 (mid-epoch) and stops; each checkpoint is resumed under
every layout to step 6. A cell shows the resumed loss at step 4 minus the uninterrupted one-device run's, and the
largest weight difference at step 6. ``lp_zero_offload`` (ZeRO-2, CPU offload) appears when DeepSpeed and its CPU ops
are installed (``scripts/test.sh`` builds them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_parallel.checkpoint.resume import TRUST_ENV
from lightning_parallel.testing import resume_matrix as rm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write every cell to this JSON file")
    parser.add_argument("--only", nargs="*", default=None, help="save layouts to run (default: all)")
    args = parser.parse_args(argv)
    rm.quiet()
    os.environ.setdefault(TRUST_ENV, "1")  # the DeepSpeed folder written here holds DeepSpeed objects
    names = list(rm.LAYOUTS)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lp_resume_matrix_") as tmp:
        folder = Path(tmp)
        ref = rm.reference(folder)
        print("uninterrupted one-device run, loss per step: "
              + ", ".join(f"{s}: {v:.6f}" for s, v in sorted(ref[1].items())), flush=True)
        cells = []
        for saved in args.only or names:
            path = rm.save(saved, folder)
            for resumed in names:
                cell = rm.resume(saved, path, resumed, folder, ref)
                cells.append(cell)
                what = (f"refused: {cell.error.splitlines()[0][:90]}" if cell.error else
                        f"loss {cell.loss:.6f} (ref {cell.reference_loss:.6f}), dw {cell.weight_diff:.1e}")
                print(f"  {saved:>18} -> {resumed:<18} {what}", flush=True)
    print(f"\n{len(cells)} cells in {time.monotonic() - start:.0f} s. Each cell: |resumed loss at step {rm.STOP + 1} - "
          f"uninterrupted| / max |w - w_uninterrupted| at step {rm.STOP + rm.MORE}\n")
    print("| saved \\ resumed | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for saved in args.only or names:
        row = []
        for resumed in names:
            cell = next(c for c in cells if c.saved == saved and c.resumed == resumed)
            row.append("refused" if cell.error else f"{cell.loss_diff:.0e} / {cell.weight_diff:.0e}")
        print(f"| {saved} | " + " | ".join(row) + " |")
    if args.json:
        args.json.write_text(json.dumps([c.__dict__ for c in cells], indent=1))
    bad = [c for c in cells if c.error or (c.loss_diff or 0) > 1e-5 or (c.weight_diff or 0) > 1e-5]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
