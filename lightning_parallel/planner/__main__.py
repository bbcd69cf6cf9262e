"""``python -m lightning_parallel.planner ARGS`` = ``lightning-parallel plan ARGS``."""

from lightning_parallel.planner.cli import main

raise SystemExit(main())
