"""The modules of ``benchmarks/bench.py`` (imported with ``benchmarks/`` on ``sys.path``; not part of the package)."""
