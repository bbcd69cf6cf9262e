"""Lightning callbacks of the library.

* :class:`CountCommunication` -- turns the strategy's communication counter on (off by default: a step counts
  nothing);
* :class:`GlobalBatch` -- ``parallel.global_batch_size`` on any data-parallel size (added by the strategies; it rescales
  the loop's batch counters when a checkpoint resumes under another accumulation);
* :class:`ModelStateReport` -- the planner's model-state bytes per rank against the measured ones (``lp_auto``);
* :class:`NonFiniteLossGuard` -- a NaN/inf training loss stops every rank on that step, never reaching a checkpoint
  (every library strategy installs one; ``action="skip"`` skips such steps instead);
* :class:`PeriodicCheckpoint` -- a checkpoint every N steps and/or M minutes, written in the background;
* :class:`PreemptionCheckpoint` -- ``ModelCheckpoint`` that saves when a preemption (SIGTERM, Ctrl-C) stops every rank;
* :class:`ResumableDataLoaders` -- exact mid-epoch resume of the training DataLoader under Lightning's own strategies
  (the library's strategies do it themselves; the CLI adds it to every run);
* :class:`RunSummary` -- the one-line summary the CLI prints when ``fit`` ends (added to every CLI run);
* :class:`TileLinearLayers` -- Memory Centric Tiling as a callback: tiles large ``nn.Linear`` layers in ``setup``
  (recipes name it as ``lightning_parallel.callbacks.TileLinearLayers``);
* :class:`ZeroStats` -- counts, and logs each optimizer step's measured per-rank model-state bytes and traffic.
"""

from lightning_parallel.callbacks.global_batch import GlobalBatch
from lightning_parallel.callbacks.model_states import ModelStateReport
from lightning_parallel.callbacks.nonfinite import NonFiniteLossError, NonFiniteLossGuard
from lightning_parallel.callbacks.periodic_checkpoint import PeriodicCheckpoint
from lightning_parallel.callbacks.preemption import PreemptionCheckpoint
from lightning_parallel.callbacks.resumable_data import ResumableDataLoaders
from lightning_parallel.callbacks.summary import WARMUP_BATCHES, RunSummary, calibrated_peak, model_flops_per_sample
from lightning_parallel.callbacks.tiling import TileLinearLayers
from lightning_parallel.callbacks.zero_stats import CountCommunication, ZeroStats

__all__ = ["WARMUP_BATCHES", "CountCommunication", "GlobalBatch", "ModelStateReport", "NonFiniteLossError",
           "NonFiniteLossGuard", "PeriodicCheckpoint", "PreemptionCheckpoint", "ResumableDataLoaders", "RunSummary",
           "TileLinearLayers", "ZeroStats", "calibrated_peak", "model_flops_per_sample"]
