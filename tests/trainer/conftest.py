"""Trainer-tier set-up: DeepSpeed's C++ ops compile once per machine (minutes on 2 cores, mostly async_io for NVMe
offload). ``scripts/test.sh`` builds them in its set-up, before pytest starts (announced). Run without that set-up,
when the ZeRO-offload tests are collected and an op is missing, the build starts in the background as soon as
collection ends, so it overlaps the tests that run before them; their module fixture then waits for it (torch's
build lock) and says so."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

_OFFLOAD_TESTS = "test_zero_offload.py"


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(Path(str(item.fspath)).name == _OFFLOAD_TESTS for item in session.items):
        return
    try:
        from lightning_parallel.parallel.offload import libaio_available, missing_ops, required_ops
    except ImportError:
        return
    try:
        names = required_ops(accelerator="cpu", offload_optimizer="cpu", offload_param="none")
        if libaio_available():
            names += ["pin_memory", "async_io"]
        todo = missing_ops(names)
    except ImportError:  # no DeepSpeed: the offload tests skip
        return
    if not todo:
        return
    log = Path(tempfile.gettempdir()) / f"lp_deepspeed_ops_{os.getpid()}.log"
    with open(log, "w") as out:
        subprocess.Popen([sys.executable, "-m", "lightning_parallel.parallel.offload.ops", *todo], stdout=out,
                         stderr=subprocess.STDOUT, start_new_session=True)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"[lp_zero_offload] building DeepSpeed ops {todo} in the background for the ZeRO-offload "
                            f"tests (first use on this machine; log {log})")
