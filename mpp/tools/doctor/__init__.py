"""``mpp doctor``: the first GPU run checks itself: the environment, every attention kernel against
``math``, and the engine (a short launcher run, the step measured in this process), each row with
a verdict and its reason in a table and ``doctor.json`` (docs/ARCHITECTURE.md §4.1, §6). Without
a GPU the GPU rows say "needs a GPU" and the rest runs (the test suite runs it that way)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PASS, WARN, FAIL, NEEDS_GPU = "pass", "warn", "fail", "needs a GPU"
VERDICTS = (PASS, WARN, FAIL, NEEDS_GPU)


@dataclass
class Row:
    """One check: its verdict, the reason in a sentence, and the figures behind it."""

    section: str
    check: str
    verdict: str
    reason: str
    values: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {VERDICTS}")


def needs_gpu(section: str, check: str, what: str) -> Row:
    """The row of a check this machine cannot run: ``what`` it would measure on a GPU."""
    return Row(section, check, NEEDS_GPU, f"not run (no CUDA device); on a GPU it {what}")
