"""The layers of the package hold: the import-linter contracts of ``pyproject.toml`` ([tool.importlinter]) pass, and
they fail on a copy of the package with a forbidden import put in, so they cannot pass vacuously.

The contracts: ``parallel/`` (torch.distributed mechanics) imports nothing of the strategies, checkpoints, command
line, planner, callbacks, data, models or Lightning; ``strategies/`` imports no command line; no two modules (or
sub-packages) of one package import each other, directly or through others. The same check from a shell, in the
repository root: ``lint-imports --no-cache``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package under ``root`` (its own copy first on the path), no cache written."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_import_contracts_hold() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, f"a layer of the package is broken:\n{result.stdout}{result.stderr}"
    assert "Contracts: 3 kept, 0 broken." in result.stdout, result.stdout


# (file of the copy, import appended to it, what the broken contract then reports)
BREAKS = (
    ("lightning_parallel/parallel/dims.py", "import lightning.pytorch",
     r"lightning_parallel\.parallel\.dims -> lightning\b"),
    ("lightning_parallel/parallel/dims.py", "import lightning_parallel.checkpoint.atomic",
     r"lightning_parallel\.parallel\.dims -> lightning_parallel\.checkpoint\.atomic"),
    ("lightning_parallel/strategies/ddp.py", "import lightning_parallel.cli",
     r"lightning_parallel\.strategies\.ddp -> lightning_parallel\.cli"),
    ("lightning_parallel/config.py", "import lightning_parallel.layouts",
     r"- \.(config -> \.layouts|layouts -> \.config) \("),
)


def test_a_forbidden_import_breaks_the_contracts(tmp_path: Path) -> None:
    """On a copy of the package: none of the reports below before; each after its import is put in."""
    shutil.copytree(ROOT / "lightning_parallel", tmp_path / "lightning_parallel",
                    ignore=shutil.ignore_patterns("__pycache__", "corpus"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    before = _lint(tmp_path)
    assert "Analyzed" in before.stdout, before.stdout + before.stderr  # the linter ran on the copy
    for _, _, report in BREAKS:
        assert not re.search(report, before.stdout), before.stdout
    for path, line, _ in BREAKS:
        with open(tmp_path / path, "a") as f:
            f.write(f"\n{line}  # put in by tests/unit/test_layers.py\n")
    after = _lint(tmp_path)
    assert after.returncode != 0, after.stdout
    for _, line, report in BREAKS:
        assert re.search(report, after.stdout), f"{line!r} was not reported:\n{after.stdout}"
