"""What a NaN/Inf loss does (``train.on_nonfinite``): ``skip`` the step on every rank, up to
``train.max_bad_steps``, then stop; ``stop`` at the first one; ``rollback``: past the limit,
every rank reloads the last complete checkpoint, the data stream moves past the window that
failed, the lr is scaled by ``train.rollback_lr_scale``, the event goes to metrics.jsonl, and
training goes on, at most ``train.max_rollbacks`` times. Users of MAE, ConvMAE and GreenMIM
restart month-long runs by hand after a NaN; this does it for them (``roll_back``; the loading
is ``mpp.checkpoint.manager.Checkpointer.restore_intact``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from mpp.checkpoint.state import RunState

log = logging.getLogger(__name__)
# a fault-injection hook (docs/pretraining.md, NaN recovery): MPP_INJECT_NONFINITE_AT_STEP=k makes the
# trainer's check (mpp.train.trainer.all_finite) report a non-finite loss at optimiser step k's first try
INJECT_ENV = "MPP_INJECT_NONFINITE_AT_STEP"


class NonFiniteLossError(RuntimeError):
    """Too many steps with a NaN/Inf loss: the run stops, its last checkpoint untouched."""


def skip_bad_step(state: RunState, t: Any, rank: int) -> bool:
    """Count a skipped micro-step (no backward, no optimiser step: returns False, "not stepped");
    NonFiniteLossError at once under ``stop``, past ``train.max_bad_steps`` otherwise."""
    state.bad_steps += 1
    step, limit = state.step + 1, (0 if t.on_nonfinite == "stop" else t.max_bad_steps)
    if rank == 0:
        log.warning(
            "non-finite loss at step %d: skipped (%d of at most %d)", step, state.bad_steps, limit
        )
    if state.bad_steps > limit:
        raise NonFiniteLossError(
            f"non-finite loss at step {step} ({state.bad_steps} such steps, train.max_bad_steps={limit}, "
            f"train.on_nonfinite={t.on_nonfinite}); the last complete checkpoint is untouched (lower the lr, check the data)"
        )
    return False


def roll_back(checkpointer: Any, state: RunState, error: NonFiniteLossError, t: Any) -> None:
    """``train.on_nonfinite=rollback``: the last complete checkpoint's weights, optimiser, RNG
    and step into ``state``, with the data stream past the window that failed and the lr
    scale reduced. Raises ``error`` (naming every failed step) when ``train.max_rollbacks``
    are used up or there is nothing to go back to."""
    failed = [*state.rollback_steps, state.step + 1]
    if t.on_nonfinite != "rollback" or len(state.rollback_steps) >= t.max_rollbacks:
        if t.on_nonfinite == "rollback":
            raise NonFiniteLossError(
                f"{error}; gave up after {len(state.rollback_steps)} rollback(s) "
                f"(train.max_rollbacks={t.max_rollbacks}) at steps {failed}"
            ) from None
        raise error
    # past the batch that failed (the caller advanced)
    position = state.epoch, state.batch_in_epoch
    lr_scale = state.lr_scale * t.rollback_lr_scale
    tag = checkpointer.restore_intact(state)
    if tag is None:
        raise NonFiniteLossError(f"{error}; no complete checkpoint to roll back to") from None
    state.epoch, state.batch_in_epoch = position
    state.rollback_steps, state.lr_scale = failed, lr_scale
    if dist.get_rank() == 0:
        log.warning(
            "non-finite losses at step %d: rolled back to %s, data moved past the window, lr x %g",
            failed[-1],
            tag,
            lr_scale,
        )
