"""Thread-based data parallel (DP): one process drives ``N`` devices (no Lightning import).

Per step: **scatter** the batch from device 0 (forward), **replicate** the parameters to every device (forward),
**apply** the replicas in threads, **gather** the outputs on device 0 (forward; the loss gradient is scattered back
in backward), **reduce** the parameter gradients on device 0 (backward). :class:`DataParallelEngine` ties the pieces
together and, when given a :class:`~lightning_parallel.parallel.counters.CommCounter`, counts every exchange in it
(:func:`~lightning_parallel.parallel.counters.counting_allreduce_hook` counts DDP's single exchange the same way).
"""

from .apply import parallel_apply
from .engine import BackwardMode, DataParallelEngine, data_parallel, default_cpu_threads
from .gather import BackwardPlan, Reduction, gather
from .replicate import LeafReplicas, replicate, replicate_leaves
from .scatter import find_sample_count, scatter, split_sizes

__all__ = [
    "BackwardMode",
    "BackwardPlan",
    "DataParallelEngine",
    "LeafReplicas",
    "Reduction",
    "data_parallel",
    "default_cpu_threads",
    "find_sample_count",
    "gather",
    "parallel_apply",
    "replicate",
    "replicate_leaves",
    "scatter",
    "split_sizes",
]
