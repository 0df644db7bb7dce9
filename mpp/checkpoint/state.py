"""The run's state, saved in every checkpoint and moved by the trainer: where it is, what it has
counted. Imports nothing of the library, so the trainer and the checkpoint manager both use it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunState:
    step: int = 0  # optimiser steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches this rank consumed in the current epoch
    samples: int = 0  # images seen, all ranks
    bad_steps: int = 0
    overflow_steps: int = 0  # fp16 steps DeepSpeed skipped on a gradient overflow
    # steps whose non-finite losses were rolled back
    rollback_steps: list[int] = field(default_factory=list)
    lr_scale: float = 1.0  # train.rollback_lr_scale per rollback
