"""``PreemptionCheckpoint``: Lightning's ``ModelCheckpoint`` that saves on a preemption stop, and only then.

``ModelCheckpoint(save_on_exception=True)`` saves on *any* exception. After a preemption (SIGTERM, or Ctrl-C, which
the library's strategies route the same way) every rank stops at the same step boundary, so the save -- a collective
under the sharded strategies -- is consistent. After a rank failure (a crash, ``kill -9``, a stuck peer) the same save
would start collectives that the lost rank never joins: the survivors would wait up to the collective timeout a
second time, and the exception raised from the save would replace the one that names the lost rank. This subclass
saves on ``SIGTERMException`` only, always; everything else is ``ModelCheckpoint``.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

__all__ = ["PreemptionCheckpoint"]


class PreemptionCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` (same arguments) that also saves -- and ``last.ckpt`` when ``save_last`` -- when a
    preemption stops training; never on other exceptions, whatever ``save_on_exception`` says."""

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        given = self.save_on_exception
        self.save_on_exception = True
        try:
            super().on_exception(trainer, pl_module, exception)
        finally:
            self.save_on_exception = given
