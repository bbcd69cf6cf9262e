"""One checkpoint API: read what ``trainer.save_checkpoint`` wrote under any of the library's strategies.

>>> from lightning_parallel.checkpoint import full_state_dict, consolidate
>>> state = full_state_dict("runs/x/last.ckpt")          # {name: full tensor}, the LightningModule's own names
>>> consolidate("runs/x/last.ckpt", "model.ckpt")         # one file: GPT.load_from_checkpoint("model.ckpt")

``lightning-parallel consolidate IN OUT`` is :func:`consolidate` on the command line. Everything runs in one CPU
process without a process group. The format is told from the files (:func:`detect_format`); anything else -- a
missing path, a foreign file (a bare ``state_dict``, a text file), a folder of another kind, an incomplete save (a
rank file missing), a corrupt file -- is refused with :class:`CheckpointFormatError`, naming the file and what was
expected.

Formats (:data:`CheckpointFormat`)
----------------------------------

``lightning`` -- one file, Lightning's checkpoint dict; ``state_dict`` holds the full weights under the
LightningModule's names. Written by ``lp_ddp`` (``lp_ddp_fork``/``_spawn``), ``lp_dp``, and ``lp_sharded`` with
``checkpoint="full"`` (the default) at stages 1, 2 and 3, native and fairscale backends (stage 3 all-gathers the
FSDP2 parameters at save time), and by any plain Lightning strategy. Read with ``weights_only=True``.

``lp_sharded`` -- a folder from ``lp_sharded`` with ``checkpoint="sharded"`` (native backend):

* ``meta.pt`` (rank 0): Lightning's checkpoint dict without ``optimizer_states`` plus
  ``lp_sharded_checkpoint = {"zero_stage", "world_size"}``; at stages 1-2 also the full ``state_dict`` (parameters
  are replicated at those stages, only the optimizer state is sharded);
* ``rank_XXXXX.pt`` (one per rank, ``world_size`` of them): ``{"optimizer_states": [this rank's flat shard]}``,
  and at stage 3 also ``"state_dict"``: this rank's FSDP2 ``Shard(0)`` pieces as plain local tensors. They are
  joined along dim 0 in rank order (``torch.chunk`` sizes: ceil(n/N) each, the remainder last); an entry identical on
  every rank is a replicated buffer and kept once. The files do not record which entries were sharded: a parameter
  whose shards are all identical is detected (the optimizer's parameter count) and refused, and a buffer that differs
  between ranks would be joined as if it were sharded (its size then no longer matches the module's).

All read with ``weights_only=True``.

``deepspeed`` -- a DeepSpeed ZeRO folder from ``lp_zero_offload`` (ZeRO-1/2/3, CPU offload or none) or Lightning's
``deepspeed`` strategy: ``latest`` (the tag, ``checkpoint``), ``<tag>/*_model_states.pt`` (Lightning's client state --
``hyper_parameters``, ``loops``, ... -- DeepSpeed's ``module``, ``param_shapes``, ``buffer_names``, ``ds_config``) and
``<tag>/*_optim_states.pt``, one per rank, holding that rank's partition of the fp32 master weights. The weights are
DeepSpeed's ``zero_to_fp32`` reconstruction (fp32 masters; buffers from the model states). The model-states file is
read with ``weights_only=True`` where its content allows (DeepSpeed 0.19 writes plain containers); the
optimizer-state files are read by DeepSpeed's ``zero_to_fp32`` with ``weights_only=False``: they hold DeepSpeed
objects (``LossScaler``, ``ZeroStageEnum``, ``fragment_address``) that ``weights_only=True`` refuses. Only read
DeepSpeed folders you trust.

``deepspeed_nvme`` -- the same folder written with NVMe offload (ZeRO-3, ``ds_config`` says ``nvme``). The parameters
come from ``lp_offload_state/lp_offload_rank<r>.pt``, the per-rank state ``lp_zero_offload`` writes beside the
checkpoint and checks value by value when it resumes (its fp32 partitions, read with ``weights_only=True``,
concatenated in rank order, padding dropped); the buffers from the model states. DeepSpeed itself neither restores
NVMe-offloaded state nor guarantees its files hold it (:mod:`lightning_parallel.parallel.offload.state`), so a folder
without those files is refused rather than read from DeepSpeed's partitions, and so are frozen parameters (not saved
there).

Names: wrapper path components (``_fsdp_wrapped_module``, ``_checkpoint_wrapped_module``, ``_orig_mod``) are removed
anywhere in a key; for DeepSpeed folders also a leading ``_forward_module.`` / ``module.`` shared by every key. Values
are CPU tensors in the dtype the module was trained in (Lightning files, sharded folders) or fp32 (DeepSpeed).

:func:`read_resumable` reads any of them (DeepSpeed NVMe folders excepted) into the one-device checkpoint *with* its
optimizer state, LR schedulers and loops -- what every strategy resumes from when the layout differs
(:mod:`lightning_parallel.checkpoint.resume`).

:func:`consolidate` writes ``state_dict`` plus the source's other top-level Lightning keys (``hyper_parameters``,
``epoch``, ``global_step``, ``loops``, ``callbacks``, ...) into one file; **optimizer and LR-scheduler states are
dropped** (a weights-only checkpoint: ``load_from_checkpoint`` works, resuming a fit from it does not), unless
``resumable=True`` (``--resumable``): then it writes :func:`read_resumable`'s dict, which a one-device fit resumes.

Code
----

:mod:`.names` holds every on-disk name once; :mod:`.formats` one module per format (its collective write, its read
on the layout that wrote it, its offline read), used by the strategies; :mod:`.verify` (checksums), :mod:`.atomic`
(``<name>.partial``, then a rename) and :mod:`.rng` serve them; :mod:`.read`, :mod:`.resume` and :mod:`.consolidate`
sit on top. Nothing in :mod:`lightning_parallel.parallel` imports this package.
"""

from .consolidate import ConsolidateResult, consolidate, main
from .errors import CheckpointFormatError, ResumeError
from .formats import CheckpointFormat, CheckpointInfo, detect_format
from .read import (
    DROPPED_KEYS,
    full_checkpoint,
    full_state_dict,
    join_zero3_shards,
    read_checkpoint,
    strip_wrapper_prefixes,
)
from .resume import read_resumable

__all__ = [
    "DROPPED_KEYS",
    "CheckpointFormat",
    "CheckpointFormatError",
    "CheckpointInfo",
    "ConsolidateResult",
    "ResumeError",
    "consolidate",
    "detect_format",
    "full_checkpoint",
    "full_state_dict",
    "join_zero3_shards",
    "main",
    "read_checkpoint",
    "read_resumable",
    "strip_wrapper_prefixes",
]
