"""How a training job's command ends (``mpp pretrain``, ``mpp finetune``): the exit status that
the launchers, ``mpp.submit`` and a requeue wrapper read."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpp.checkpoint.storage import CheckpointError, DiskFullError
from mpp.data import DataError
from mpp.train.nonfinite import NonFiniteLossError
from mpp.train.preemption import PREEMPTED_EXIT, Preempted
from mpp.train.runlock import release


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


def finish(job: Callable[[], Any], run_dir: Path, rank: int) -> tuple[int, Any]:
    """``job()`` in ``run_dir`` (released at the end, however it ends): (0, its result), or the
    status of how it stopped, said in one line: ``PREEMPTED_EXIT`` (75) after a stop signal's
    checkpoint; 1 for a non-finite loss, bad data or a full disk; 2 for no intact checkpoint."""
    try:
        return 0, job()
    except Preempted as e:
        if rank == 0:
            print(f"stopped: {e}", file=sys.stderr)
        return PREEMPTED_EXIT, None
    except (NonFiniteLossError, DataError, DiskFullError) as e:
        # DataLoader workers wrap the message in a traceback: its last line is the error
        print(f"error: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        return 1, None
    except CheckpointError as e:
        # nothing intact to resume from: the files are named
        print(f"error: {e}", file=sys.stderr)
        return 2, None
    finally:
        release(run_dir)
