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
