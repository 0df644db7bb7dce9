"""The ``Checkpointer``: a run's checkpoints saved, resumed, rolled back to, and its final
``encoder.safetensors``. ``restore`` loads a checkpoint into this run whatever world size, micro
batch or accumulation wrote it (the global batch stays: ``mpp.train.plan.check_resume``); another
world size goes through ``mpp.checkpoint.elastic``.

- The data position: an epoch's order does not depend on the world size (``mpp.data.order``),
  so the step in the epoch carries over; the micro-batch count is rescaled to this run's
  accumulation.
- RNG: per-rank streams cannot carry over to other ranks; they are re-derived from
  (seed, rank, step), so a given layout resumes the same way every time.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mpp.checkpoint import elastic
from mpp.checkpoint import format as ckpt
from mpp.config import RunConfig, save_config
from mpp.hub.encoder_file import export_encoder
from mpp.parallel.distributed import from_rank0
from mpp.train.nonfinite import NonFiniteLossError
from mpp.train.plan import Plan, RunState
from mpp.train.preemption import Preempted, StopRequest, write_marker
from mpp.train.rng import rng_state, seed_everything, set_rng_state

log = logging.getLogger(__name__)


class Checkpointer:
    """``RUN/checkpoints``: a complete checkpoint every ``train.ckpt_every`` steps and at the end
    (``keep_last`` kept), on a stop signal, and the final encoder. Every rank calls every method."""

    def __init__(self, engine: Any, run_dir: Path, cfg: RunConfig, plan: Plan) -> None:
        self.engine, self.objective, self.run_dir, self.cfg, self.plan = (
            engine,
            engine.module,
            run_dir,
            cfg,
            plan,
        )
        self.root = run_dir / "checkpoints"
        self.keep_last, self.interval = cfg.train.keep_last, cfg.train.ckpt_every

    def resume(self, spec: str | None) -> RunState:
        """The run state to start from: ``spec`` (None, "auto" or a path) resolved on rank 0 to the
        newest intact checkpoint, loaded for this layout; a fresh state when there is none."""
        state = RunState()
        found = from_rank0(resolve_on_rank0(spec, self.root))
        if isinstance(found, str):
            raise ckpt.CheckpointError(found)
        if found:  # any world size, micro batch or accumulation
            state = restore(
                self.engine, self.objective, found[0], found[1], self.plan, self.cfg.train.seed
            )
            if dist.get_rank() == 0:
                log.info("resumed from %s/%s at step %d", found[0], found[1], state.step)
        if dist.get_rank() == 0:
            (self.run_dir / "preempted.json").unlink(missing_ok=True)  # this run is going again
            # a warning now if keep_last + 1 do not fit
            ckpt.room(self.engine, self.root, self.keep_last)
        return state

    def save(self, state: RunState) -> None:
        """A complete checkpoint: DeepSpeed's files, the run state, every rank's RNG states and the
        objective's per-rank state."""
        rngs = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, rng_state())
        client = {"state": asdict(state), "rng": rngs}
        ckpt.save_checkpoint(
            self.engine,
            self.root,
            state.step,
            client,
            self.keep_last,
            rank_state=self.objective.rank_state(),
        )

    def maybe_save(self, state: RunState, stop: int, stop_request: StopRequest) -> None:
        """After an optimiser step: a checkpoint when due (every ``interval`` steps, and at ``stop``);
        when any rank got a stop signal, one here (unless just written) and ``Preempted``."""
        due = state.step % self.interval == 0 or state.step == stop
        if due:
            self.save(state)
        signum = stop_request.agreed()
        if signum:
            if not due:
                self.save(state)
            write_marker(self.run_dir, state.step, signum, stop_request.reason)
            raise Preempted(state.step, signum, stop_request.reason)

    def rollback(self, state: RunState, error: NonFiniteLossError) -> None:
        """``train.on_nonfinite=rollback``: the last complete checkpoint's weights, optimiser, RNG
        and step into ``state``, with the data stream past the window that failed and the lr
        scale reduced. Raises ``error`` (naming every failed step) when ``train.max_rollbacks``
        are used up or there is nothing to go back to."""
        t = self.cfg.train
        failed = [*state.rollback_steps, state.step + 1]
        if t.on_nonfinite != "rollback" or len(state.rollback_steps) >= t.max_rollbacks:
            if t.on_nonfinite == "rollback":
                raise NonFiniteLossError(
                    f"{error}; gave up after {len(state.rollback_steps)} rollback(s) "
                    f"(train.max_rollbacks={t.max_rollbacks}) at steps {failed}"
                ) from None
            raise error
        tag = from_rank0(_intact(self.root) if dist.get_rank() == 0 else None)
        if tag is None:
            raise NonFiniteLossError(f"{error}; no complete checkpoint to roll back to") from None
        position = (
            state.epoch,
            state.batch_in_epoch,
        )  # past the batch that failed (the caller advanced)
        lr_scale = state.lr_scale * t.rollback_lr_scale
        # maybe a resume's layout
        loaded = restore(self.engine, self.objective, self.root, tag, self.plan, t.seed)
        for key, value in asdict(loaded).items():
            setattr(state, key, value)
        state.epoch, state.batch_in_epoch = position
        state.rollback_steps, state.lr_scale = failed, lr_scale
        if dist.get_rank() == 0:
            log.warning(
                "non-finite losses at step %d: rolled back to %s, data moved past the window, lr x %g",
                failed[-1],
                tag,
                lr_scale,
            )

    def export_encoder(self) -> None:
        """fp32 ``encoder.safetensors`` for downstream: from the final checkpoint (ZeRO, bf16) or
        the module itself (fp32, stage 0)."""
        sd = ckpt.full_state_dict(self.engine, self.root, ckpt.latest_complete(self.root))
        if dist.get_rank() == 0:
            model = self.objective
            # hpm: base.encoder.
            prefix = next(n for n, m in model.named_modules() if m is model.encoder) + "."
            out = self.run_dir / "encoder.safetensors"
            export_encoder(sd, encoder_kwargs(self.cfg, model.encoder), out, prefix=prefix)
            save_config(self.cfg, self.run_dir / "encoder_config.json")
        dist.barrier()


def resolve_on_rank0(resume: str | None, ckpt_root: Path) -> tuple[str, str] | str | None:
    """Rank 0: the checkpoint to resume from, (root, tag), None, or the problem as a line."""
    if dist.get_rank() != 0:
        return None
    try:
        return ckpt.resolve_resume(resume, ckpt_root)  # the newest intact checkpoint: files checked
    except (
        FileNotFoundError,
        ckpt.CheckpointError,
    ) as e:  # every rank must learn it, not wait in the broadcast
        return str(e)


def _intact(ckpt_root: Path) -> str | None:
    try:
        return ckpt.newest_intact(ckpt_root)
    except ckpt.CheckpointError:  # none intact: nothing to go back to
        return None


def encoder_kwargs(cfg: RunConfig, encoder: torch.nn.Module) -> dict:
    """The exported encoder's architecture: the config's variant and overrides, and a classifier's head."""
    kwargs = {"name": cfg.model.name, **cfg.model.vit_kwargs()}
    if encoder.num_classes > 0:
        kwargs.update(num_classes=encoder.num_classes, global_pool=encoder.global_pool)
    return kwargs


def restore(
    engine: Any, objective: torch.nn.Module, root: str | Path, tag: str, plan: Plan, seed: int
) -> RunState:
    """Every rank: the checkpoint's weights, optimiser, run state and RNG, for this run's layout."""
    saved = ckpt.saved_layout(root, tag)
    world, rank = dist.get_world_size(), dist.get_rank()
    same = saved.get("world_size", world) == world
    if same or engine.zero_optimization_stage() == 0:
        with ckpt.weights_only_loads():  # a checkpoint is untrusted input
            _, client = engine.load_checkpoint(str(root), tag=tag)
    else:
        client = elastic.load_universal(engine, Path(root), tag)
    state = RunState(**client["state"])
    accum = saved.get("grad_accum", plan.grad_accum)
    # the step in the epoch carries over, in this run's micro-batches
    if accum != plan.grad_accum or not same:
        state.batch_in_epoch = math.ceil(state.batch_in_epoch / accum) * plan.grad_accum
    if same:
        set_rng_state(client["rng"][rank])
    else:
        seed_everything(seed + rank + 1_000_003 * state.step)
    # HPM's fp32 EMA under bf16: whole below ZeRO-3, a shard at 3
    rank_state = ckpt.load_rank_state(root, tag)
    if not same and engine.zero_optimization_stage() == 3:
        if rank_state and rank == 0:
            log.warning(
                "elastic resume: the per-rank state of %s/%s (HPM's fp32 EMA) is ZeRO-3 shards of another "
                "world size: it restarts from the weights",
                root,
                tag,
            )
        rank_state = {}
    objective.load_rank_state(rank_state)
    if rank == 0 and not same:
        log.info(
            "elastic resume: %s/%s written by %d rank(s) (micro batch %s), now %d (micro batch %d); "
            "the epoch continues at step %d",
            root,
            tag,
            saved["world_size"],
            saved.get("micro_batch"),
            world,
            plan.micro_batch,
            state.step,
        )
    return state
