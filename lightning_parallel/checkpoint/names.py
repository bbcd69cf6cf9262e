"""Every name the library's checkpoints use on disk -- files, folders, top-level keys -- defined here and nowhere else.

The format modules (:mod:`lightning_parallel.checkpoint.formats`) write and read them; the strategies, the readers and
the verification take them from here. Names another library owns (Lightning's checkpoint keys such as
``state_dict``, DeepSpeed's ``*_model_states.pt``, torch DCP's ``.metadata``) are listed where the library's code
depends on them. Changing any value makes existing checkpoints unreadable.
"""

from __future__ import annotations

__all__ = [
    "DCP_FOLDER_KEY",
    "DCP_LAYOUT_KEYS",
    "DCP_METADATA_FILE",
    "DCP_MODEL_KEY",
    "DCP_OPTIM_KEY",
    "DEEPSPEED_DEFAULT_TAG",
    "DEEPSPEED_LATEST_FILE",
    "DEEPSPEED_MODEL_STATES_GLOB",
    "DEEPSPEED_OPTIM_STATES_GLOB",
    "DEEPSPEED_RANK0_MODEL_STATES",
    "FORMAT_VERSION",
    "FORMAT_VERSION_KEY",
    "LAYOUT_FILE",
    "MANIFEST_FILE",
    "META_FILE",
    "NVME_STATE_DIR",
    "NVME_STATE_FILE",
    "NVME_STATE_GLOB",
    "OLD_SUFFIX",
    "OPTIMIZER_GROUPS_KEY",
    "PARTIAL_SUFFIX",
    "RANK_FILE",
    "RANK_FILE_GLOB",
    "RESUMED_FROM_KEY",
    "RNG_KEY",
    "SHARDED_KEY",
    "nvme_state_file",
    "rank_file",
]

# ---------------------------------------------------------------------------------------------- every format
FORMAT_VERSION = 1
"""The version of the on-disk layout this code writes, and the newest it reads. 0: written before versions existed
(read as before); 1: the version is recorded, and every folder format carries :data:`MANIFEST_FILE`. A checkpoint of
a higher version is refused, naming both versions."""
FORMAT_VERSION_KEY = "lp_format_version"
"""Top-level key of the Lightning checkpoint dict (a one-file checkpoint, an lp_sharded or DCP ``meta.pt``, a DeepSpeed
folder's client state) holding :data:`FORMAT_VERSION`; ``layout.json`` holds it as ``format_version``."""
RNG_KEY = "lp_rng_states"
"""Top-level key: every rank's RNG states (:mod:`lightning_parallel.checkpoint.rng`)."""
PARTIAL_SUFFIX = ".partial"
"""A checkpoint folder is written as ``<name>.partial`` and renamed once complete (:mod:`.atomic`)."""
OLD_SUFFIX = ".old"
"""The previous checkpoint of the same name, moved aside during the rename."""
MANIFEST_FILE = "checksums.json"
"""A checkpoint folder's CRC-32 and size per file, written last by rank 0 (every folder format from version 1; a DCP
folder without it is refused: DCP's ``.distcp`` shards carry no checksums of their own)."""

# ---------------------------------------------------------------------------------------------- lp_sharded folder
META_FILE = "meta.pt"
"""Rank 0's file of a folder: Lightning's checkpoint dict without the sharded tensors (lp_sharded and DCP folders)."""
SHARDED_KEY = "lp_sharded_checkpoint"
"""``meta.pt`` key of an lp_sharded folder: ``{"zero_stage", "world_size", "sharded_shapes"}``."""
RANK_FILE = "rank_{rank:05d}.pt"
"""One per rank in an lp_sharded folder: its optimizer shard (and at stage 3 its weight shards)."""
RANK_FILE_GLOB = "rank_*.pt"


def rank_file(rank: int) -> str:
    """The file name of rank ``rank``'s part of an lp_sharded folder."""
    return RANK_FILE.format(rank=rank)


# ---------------------------------------------------------------------------------------------- DCP folders
LAYOUT_FILE = "layout.json"
"""Rank 0's plain-JSON record of the layout that wrote a DCP folder (``strategy`` and the degrees)."""
DCP_METADATA_FILE = ".metadata"
"""torch DCP's own index of a folder's ``.distcp`` shards."""
DCP_LAYOUT_KEYS = {
    "lp_tensor": "lp_tensor_checkpoint",
    "lp_pipeline": "lp_pipeline_checkpoint",
    "lp_hybrid": "lp_hybrid_checkpoint",
}
"""``meta.pt`` key of a DCP folder, by the strategy that wrote it: the layout record (as in ``layout.json``)."""
OPTIMIZER_GROUPS_KEY = "optimizer_param_groups"
"""``meta.pt`` key of a DCP folder: each optimizer's ``param_groups`` with parameters named by their FQN."""
DCP_MODEL_KEY = "model"
"""DCP entry of the module's ``state_dict()``."""
DCP_OPTIM_KEY = "optim"
"""DCP entry of the optimizer states: ``optim.<i>.state.<fqn>.<key>``."""

# ---------------------------------------------------------------------------------------------- DeepSpeed folders
DEEPSPEED_LATEST_FILE = "latest"
"""DeepSpeed's file naming the tag (sub-folder) of the newest save."""
DEEPSPEED_DEFAULT_TAG = "checkpoint"
"""The tag Lightning's ``DeepSpeedStrategy`` saves under."""
DEEPSPEED_MODEL_STATES_GLOB = "*_model_states.pt"
DEEPSPEED_OPTIM_STATES_GLOB = "*_optim_states.pt"
DEEPSPEED_RANK0_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
"""Rank 0's model-states file (ZeRO-1/2, ZeRO-3): Lightning's client state, ``param_shapes``, ``ds_config``."""
NVME_STATE_DIR = "lp_offload_state"
"""Sub-folder of an lp_zero_offload folder written with NVMe offload: each rank's offloaded state."""
NVME_STATE_FILE = "lp_offload_rank{rank:05d}.pt"
NVME_STATE_GLOB = "lp_offload_rank*.pt"


def nvme_state_file(rank: int) -> str:
    """The file name of rank ``rank``'s NVMe-offloaded state (in :data:`NVME_STATE_DIR`)."""
    return NVME_STATE_FILE.format(rank=rank)


# ---------------------------------------------------------------------------------------------- in memory only
RESUMED_FROM_KEY = "lp_resumed_from"
"""Set in the one-device dict :func:`~lightning_parallel.checkpoint.resume.read_resumable` returns: its source."""
DCP_FOLDER_KEY = "_lp_dcp_folder"
"""Set in the dict a DCP folder's ``load_checkpoint`` returns: the folder its tensors are read from afterwards."""
