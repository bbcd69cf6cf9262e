"""Helpers to test distributed code on CPU: run a function on N gloo ranks."""

from lightning_parallel.testing.distributed import DistributedTestError, find_free_port, run_distributed

__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]
