"""Plain ``torch.distributed`` mechanics (no Lightning import): degrees and mesh, engines, composition."""

from lightning_parallel.parallel.dims import MESH_AXES, ParallelDims, RankCoords

__all__ = ["MESH_AXES", "ParallelDims", "RankCoords"]
