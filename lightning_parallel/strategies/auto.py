"""The ``lp_auto`` name in Lightning's registry.

``lp_auto`` needs the module to plan (its parameter count, largest layer and shape), which ``Trainer(strategy=...)``
does not have when it is built. The CLI resolves the name itself (:mod:`lightning_parallel.auto`); a script plans with
:func:`lightning_parallel.auto.plan_for_module` and passes the strategy it makes. Giving the bare name to a
``Trainer`` ends with that advice, before anything starts, instead of Lightning's "not a registered strategy".
"""

from __future__ import annotations

from typing import Any

from lightning_parallel.config import LayoutError

__all__ = ["LPAutoStrategy"]


class LPAutoStrategy:
    """Registered as ``lp_auto`` so that ``Trainer(strategy="lp_auto")`` says what to do; never a real strategy."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise LayoutError(
            "strategy='lp_auto' plans from the module, which Trainer(...) does not have yet. From the command line "
            "`lightning-parallel fit --trainer.strategy lp_auto` does it; in a script: decision = "
            "lightning_parallel.auto.plan_for_module(model, accelerator=..., devices=..., precision=...); "
            "print(decision.text()); Trainer(strategy=decision.make_strategy(), ...)."
        )
