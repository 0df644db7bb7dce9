"""Modules that moved say where to: ``import mpp.plan`` raises an ImportError naming
``mpp.tools.planner``, and ``python -m mpp.plan`` prints the command that replaced it and exits 2.
A finder first on ``sys.meta_path`` (installed by ``import mpp``) answers for these names only
(before the path finder: a folder left behind with its ``__pycache__`` would otherwise import as
an empty namespace package)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

# old name -> (where it lives now, the command that replaces its ``python -m`` form or None)
MOVED = {
    "mpp.plan": ("mpp.tools.planner", "mpp plan"),
    "mpp.doctor": ("mpp.tools.doctor", "mpp doctor"),
    "mpp.benchmarks": ("mpp.tools.benchmarks", "mpp bench"),
    "mpp.data.bench": ("mpp.tools.benchmarks.data_timing", "mpp bench data"),
    "mpp.downstream": ("mpp.transfer", None),
    "mpp.train.checkpoint": ("mpp.checkpoint.format and mpp.hub.encoder_file", None),
    "mpp.train.checkpointer": ("mpp.checkpoint.manager", None),
    "mpp.train.storage": ("mpp.checkpoint.storage", None),
    "mpp.pretrained": ("mpp.hub.pretrained", None),
}


def message(name: str) -> str:
    home, command = MOVED[name]
    run = f"; run `{command}`" if command else ""
    return f"{name} moved to {home}{run}"


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in MOVED else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(message(module.__name__), name=module.__name__)

    def get_code(self, name):
        """What ``python -m OLD`` runs (runpy asks the loader for code): one line, exit 2."""
        code = f"import sys\nprint({message(name)!r}, file=sys.stderr)\nsys.exit(2)"
        return compile(code, f"<{name} moved>", "exec")


def install() -> None:
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.insert(0, _Moved())
