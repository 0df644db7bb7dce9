"""What an exact resume restores besides the weights, saved in every checkpoint: the run's state
(moved by the trainer: where it is, what it has counted) and each rank's RNG states; and seeding.
Imports nothing of the library, so the trainer and the checkpoint manager both use it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


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
    # bad samples all ranks skipped, as of the last metrics record (metrics.jsonl's `skipped`)
    skipped: int = 0


def rng_state() -> dict[str, Any]:
    """This process's RNG states, as plain lists and tensors (loadable with weights_only)."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        # this rank's device only: a resume may see fewer GPUs (8x8 as 16x4, one per SLURM task)
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() else [],
        "python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(_own_device_state(s["cuda"], torch.cuda.current_device()))
    v, internal, gauss = s["python"]
    random.setstate((v, tuple(internal), gauss))
    n = s["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))


def _own_device_state(states: list, device: int):
    """One state is this rank's; a list of every visible GPU's (checkpoints before this format)
    holds it at the device index the rank used then, its local rank, which is ours again."""
    return states[0] if len(states) == 1 else states[min(device, len(states) - 1)]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
