"""``mpp doctor``: the first GPU run checks itself (issue 22, item 3).

Three sections, each a list of rows with a verdict and its reason:
  environment   torch / CUDA / NCCL, the xformers wheel, bf16, DeepSpeed's JIT-built ops
  attention     every kernel against the project's ``math`` backend, and which one is fastest
  engine        a short ``deepspeed pretrain/run.py`` run, and the step measured in this process
On a machine without a GPU the GPU rows say "needs a GPU" and the rest runs (the test suite
runs it that way). Results: a table on stdout and ``doctor.json``.
"""

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
