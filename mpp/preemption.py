"""Stopping a run cleanly when the cluster asks (SLURM sends SIGUSR1 ahead of time with
``#SBATCH --signal=USR1@120``, SIGTERM at the end; DeepSpeed's launcher forwards SIGTERM).

A signal only sets a flag; at every optimiser step the ranks agree on it (one all-reduce of
one CPU number, on a gloo group so it never waits for the GPU), so they all stop after the
same step, write one complete checkpoint and exit with ``PREEMPTED_EXIT``. ``--resume auto``
then continues exactly.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import torch
import torch.distributed as dist

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: try again (a requeue wrapper tests for it)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped on a signal after a complete checkpoint at ``step``."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"preempted by {signal.Signals(signum).name} after step {step}: a complete checkpoint "
                         f"is saved; continue with --resume auto")  # fmt: skip
        self.step, self.signum = step, signum


class StopRequest:
    """Installs the handlers (every rank, before the data workers start: they inherit them and
    only set their own copy of the flag, so they keep serving until the rank stops)."""

    def __init__(self) -> None:
        self.signum = 0
        self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        backend = dist.get_backend() if dist.is_initialized() else None
        # the control flag goes over gloo: on NCCL a CPU tensor cannot, and a GPU one would sync the step
        self.group = None if backend in (None, "gloo") else dist.new_group(backend="gloo")

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def agreed(self) -> int:
        """The signal any rank got (0: none), the same on every rank. A collective: every rank calls it."""
        flag = torch.tensor([self.signum], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def write_marker(run_dir: Path, step: int, signum: int) -> None:
    """``RUN/preempted.json`` on rank 0: what stopped the run and where (a requeue script reads it)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        record = {"step": step, "signal": signal.Signals(signum).name, "exit_status": PREEMPTED_EXIT}
        (run_dir / "preempted.json").write_text(json.dumps(record) + "\n")
