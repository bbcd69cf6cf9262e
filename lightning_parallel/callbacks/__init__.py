"""Lightning callbacks of the library.

* :class:`RunSummary` -- the one-line summary the CLI prints when ``fit`` ends (added to every CLI run);
* :class:`TileLinearLayers` -- Memory Centric Tiling as a callback: tiles large ``nn.Linear`` layers in ``setup``
  (recipes name it as ``lightning_parallel.callbacks.TileLinearLayers``).
"""

from lightning_parallel.callbacks.summary import RunSummary
from lightning_parallel.callbacks.tiling import TileLinearLayers

__all__ = ["RunSummary", "TileLinearLayers"]
