"""How a training job's command ends (``mpp pretrain``, ``mpp finetune``): the exit status that
the launchers, ``mpp.submit`` and a requeue wrapper read."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mpp.checkpoint.storage import CheckpointError, DiskFullError
from mpp.config import ConfigError
from mpp.data import DataError
from mpp.parallel.distributed import PortInUse
from mpp.train.nonfinite import NonFiniteLossError
from mpp.train.preemption import PREEMPTED_EXIT, Preempted


def ending(state: Any, run_dir: Path, seconds: float, weights: str) -> str:
    """The line a training run ends with: steps, images, the last figures, this invocation's
    time and the run's recent img/s, and where it all is (its curves drawn: ``mpp plot``)."""
    from mpp.tools.plot import curves_at_end
    from mpp.train.metrics import last_figures, read_records

    recent = [r["imgs_per_sec"] for r in read_records(run_dir)[-5:]]
    rate = f", {sorted(recent)[len(recent) // 2]:.0f} img/s" if recent else ""
    minutes, secs = divmod(round(seconds), 60)
    figures = last_figures(run_dir)
    return (
        f"done: {state.step} steps, {state.samples} images in {minutes}m{secs:02d}s{rate}"
        + (f"; {figures}" if figures else "")
        + f" -> {run_dir}: metrics.jsonl, {curves_at_end(run_dir)}, checkpoints/, {weights}"
    )


# the one mapping from how a job stopped to its exit status (a subclass before its base)
EXIT_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (Preempted, PREEMPTED_EXIT),  # a complete checkpoint saved: the same command goes on
    (NonFiniteLossError, 1),
    (DataError, 1),
    (DiskFullError, 1),
    (CheckpointError, 2),  # nothing intact to resume from: the files are named
    (ConfigError, 2),  # RunHeld too: refused before anything was created
    (PortInUse, 2),
)


def exit_status(error: BaseException) -> int | None:
    """The exit status of a job stopped by ``error``; None for an error that is a bug."""
    return next((status for kind, status in EXIT_STATUS if isinstance(error, kind)), None)


def run_command(job: Callable[[], Any], rank: int) -> tuple[int, Any]:
    """``job()``: (0, its result), or the exit status of how it stopped (``EXIT_STATUS``), said
    in one line: by rank 0 where every rank stops alike (a stop signal, a refusal once the
    process group exists), else by each rank. An error that is not in the mapping propagates."""
    try:
        return 0, job()
    except tuple(kind for kind, _ in EXIT_STATUS) as e:
        if isinstance(e, Preempted):
            line = f"stopped: {e}"
        else:  # DataLoader workers wrap the message in a traceback: its last line is the error
            text = str(e).strip()
            line = f"error: {text.splitlines()[-1] if isinstance(e, (NonFiniteLossError, DataError, DiskFullError)) else text}"
        alike = isinstance(e, Preempted) or (
            isinstance(e, (ConfigError, PortInUse)) and dist.is_initialized()
        )
        if rank == 0 or not alike:
            print(line, file=sys.stderr)
        return exit_status(e), None
