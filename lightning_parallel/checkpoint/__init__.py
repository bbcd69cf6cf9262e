"""One checkpoint API: read what ``trainer.save_checkpoint`` wrote under any of the library's strategies.

>>> from lightning_parallel.checkpoint import full_state_dict, consolidate
>>> state = full_state_dict("runs/x/last.ckpt")          # {name: full tensor}, the LightningModule's own names
>>> consolidate("runs/x/last.ckpt", "model.ckpt")         # one file: GPT.load_from_checkpoint("model.ckpt")

``lightning-parallel consolidate IN OUT`` is :func:`consolidate` on the command line. Everything runs in one CPU
process without a process group. The format is told from the files (:func:`detect_format`); anything else -- a
missing path, a foreign file (a bare ``state_dict``, a text file), a folder of another kind, an incomplete save (a
rank file missing), a corrupt file -- is refused with :class:`CheckpointFormatError`, naming the file and what was
expected.

Formats (:data:`CheckpointFormat`), one module each (docs/checkpoints.md describes them)
-----------------------------------------------------------------------------------------

* ``lightning`` (:mod:`.formats.lightning_file`) -- one file, Lightning's checkpoint dict: ``lp_ddp``, ``lp_dp``,
  ``lp_sharded`` with ``checkpoint="full"`` (stage 3 gathers the FSDP2 shards when saving), any plain Lightning
  strategy;
* ``lp_sharded`` (:mod:`.formats.sharded`) -- ``meta.pt`` + one ``rank_XXXXX.pt`` per rank (``checkpoint="sharded"``);
* ``lp_tensor``, ``lp_pipeline``, ``lp_hybrid`` (:mod:`.formats.dcp`) -- a torch DCP folder, one shard file per rank;
* ``deepspeed``, ``deepspeed_nvme`` (:mod:`.formats.deepspeed`) -- DeepSpeed's ZeRO folder (``lp_zero_offload``,
  Lightning's ``deepspeed``), with NVMe offload also the per-rank ``lp_offload_state/`` files that hold its weights.

Lightning files and lp_sharded folders are read with ``weights_only=True``; DeepSpeed's optimizer-state files hold
DeepSpeed objects (``LossScaler``, ``ZeroStageEnum``, ``fragment_address``) that only ``weights_only=False`` reads:
only read DeepSpeed folders you trust.

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
    LoadsAnyFormat,
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
    "LoadsAnyFormat",
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
