"""Shared test set-up: tiers are folders (unit / distributed / trainer / gpu); GPU tests skip without CUDA."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# Two cores: one intra-op thread per process keeps multi-rank tests from oversubscribing the machine.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests never calibrate (or read a calibration of) the machine implicitly: the planner uses profile or default rates.
os.environ["LIGHTNING_PARALLEL_CALIBRATION"] = "none"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture(autouse=True)
def no_thread_left_behind() -> Iterator[None]:
    """A test must not leave a thread running in the pytest process: the fork launchers copy this process for every
    later test's ranks, and a forked child of a multi-threaded parent can deadlock or crash (a thread's lock or C++
    state copied mid-use)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 2.0
    left = [t for t in threading.enumerate() if t not in before]
    for thread in left:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [f"{t.name} ({'daemon' if t.daemon else 'not daemon'})" for t in left if t.is_alive()]
    if alive:
        pytest.fail(f"the test left thread(s) running in the pytest process: {', '.join(alive)}. Stop them (join) "
                    "before the test ends: later tests fork this process.", pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def environment_restored_after_each_module() -> Iterator[None]:
    """Environment variables a module sets (``LIGHTNING_PARALLEL_TRUST_CHECKPOINTS`` in module-scoped fixtures,
    Lightning's ``MASTER_PORT``/``LOCAL_RANK`` written by an in-process fit, ...) end with the module: a later module
    must see the environment the suite started with (a leaked trust flag once changed a later test's message)."""
    before = dict(os.environ)
    yield
    for key in set(os.environ) - set(before):
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
