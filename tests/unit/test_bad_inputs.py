"""Every bad input of the table (lightning_parallel/testing/bad_inputs.py) is refused once, clearly, before spawn.

One test runs all cases in this process with the launchers trapped (a case that would start a rank fails), and
prints the table: case, exit code, first line of the message, seconds, spawned or not. ``-s`` shows it.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch.distributed

from lightning_parallel.testing.bad_inputs import CASES, make_fixtures, run_in_process


class _Launched(RuntimeError):
    pass


def test_every_bad_input_is_refused_before_spawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(CASES) >= 40
    make_fixtures(tmp_path)
    started: list[str] = []

    def trap(*args: Any, **kwargs: Any) -> Any:
        started.append(str(args[0] if args else kwargs))
        raise _Launched("a rank would have been started")

    from lightning.pytorch.strategies.launchers import multiprocessing as mp_launcher
    from lightning.pytorch.strategies.launchers import subprocess_script

    monkeypatch.setattr(subprocess_script.subprocess, "Popen", trap)
    monkeypatch.setattr(mp_launcher.mp, "start_processes", trap)
    monkeypatch.setattr(multiprocessing.get_context("fork"), "Process", trap, raising=False)
    monkeypatch.setattr(torch.distributed, "init_process_group", trap)  # a rank joining a world: too late
    rows, failures = [], []
    for case in CASES:
        before = len(started)
        outcome = run_in_process(case, tmp_path)
        spawned = outcome.spawned or len(started) > before
        rows.append(f"| {case.name} | {outcome.code} | {outcome.first_line[:110]} | {outcome.seconds:.1f} | "
                     f"{'yes' if spawned else 'no'} |")
        problems = []
        if outcome.code != case.code:
            problems.append(f"exit code {outcome.code}")
        if outcome.traceback:
            problems.append(f"traceback {outcome.traceback[:300]}")
        if spawned:
            problems.append("a rank was started")
        if case.expect not in outcome.output:
            problems.append(f"message lacks {case.expect!r}")
        if problems:
            failures.append(f"{case.name}: {'; '.join(problems)}\n    {outcome.output[-600:]}")
    table = "\n".join(["| case | exit | first line of the message | s | spawned |", "|---|---|---|---|---|", *rows])
    print(f"\n{table}")
    assert not failures, "\n".join(failures) + "\n" + table
