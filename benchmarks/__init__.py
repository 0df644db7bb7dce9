"""Benchmark suites, run as ``python -m benchmarks SUITE [--quick] [--out FILE.json]``.

Each suite is a module with ``run(quick, **options) -> dict`` (JSON-ready: the figures, the
setting and the goal) and ``render(result) -> str`` (the tables printed). The latest full
figures live in BENCHMARKS.md at the repository root.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# suite name -> module (each imports only torch and mpp; the launcher runs stay in subprocesses)
SUITES = {
    "cpu-step": "benchmarks.step",
    "attention": "benchmarks.attention",
    "data": "benchmarks.data",
    "decode": "benchmarks.decode",
    "zero": "benchmarks.zero",
    "gpu-step": "benchmarks.gpu_step",
    "host": "benchmarks.host",
    "preview": "benchmarks.preview",
    "monitor": "benchmarks.monitor",
    "compiled-run": "benchmarks.compiled_run",
    "feed": "benchmarks.feed",
}


def suite(name: str) -> ModuleType:
    """The module of the suite called ``name``."""
    if name not in SUITES:
        raise ValueError(f"unknown benchmark suite {name!r}; allowed: {sorted(SUITES)}")
    return importlib.import_module(SUITES[name])


__all__ = ["SUITES", "suite"]
