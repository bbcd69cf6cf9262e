"""The multi-rank test harness: :mod:`lightning_parallel.parallel.local_ranks`, under the name the tests use."""

from lightning_parallel.parallel.local_ranks import DistributedTestError, find_free_port, run_distributed

__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]
