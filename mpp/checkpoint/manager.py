"""The ``Checkpointer``: a run's checkpoints saved, resumed, rolled back to, and its final
``encoder.safetensors``. A checkpoint holds four parts, saved by ``save`` and loaded by
``restore`` (docs/ARCHITECTURE.md §5.2), for this run whatever world size, micro batch or
accumulation wrote it (the global batch stays: ``mpp.train.plan.check_resume``).
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
from mpp.checkpoint.state import RunState, rng_state, seed_everything, set_rng_state
from mpp.config import RunConfig, save_config
from mpp.hub.encoder_file import export_encoder
from mpp.parallel.distributed import from_rank0

log = logging.getLogger(__name__)


class Checkpointer:
    """``RUN/checkpoints``: the complete checkpoints the trainer asks for (every
    ``train.ckpt_every`` steps, at the end, on a stop signal; ``keep_last`` kept), the resume, the
    rollback and the final encoder. Every rank calls every method."""

    def __init__(self, engine: Any, run_dir: Path, plan: Any, keep_last: int, seed: int) -> None:
        self.engine, self.objective, self.run_dir = engine, engine.module, run_dir
        self.plan, self.root = plan, run_dir / "checkpoints"
        self.keep_last, self.seed = keep_last, seed

    def resume(self, spec: str | None) -> RunState:
        """The run state to start from: ``spec`` (None, "auto" or a path) resolved on rank 0 to the
        newest intact checkpoint, loaded for this layout; a fresh state when there is none."""
        state = RunState()
        found = resolve_on_rank0(spec, self.root)
        if isinstance(found, str):
            raise ckpt.CheckpointError(found)
        if found:  # any world size, micro batch or accumulation
            self.restore(found[0], found[1], state)
            if dist.get_rank() == 0:
                log.info("resumed from %s/%s at step %d", found[0], found[1], state.step)
        if dist.get_rank() == 0:
            (self.run_dir / "preempted.json").unlink(missing_ok=True)  # this run is going again
            # saves cut off before their marker: no rank writes one before the first save,
            # which waits for rank 0
            if removed := ckpt.remove_incomplete(self.root):
                log.info(
                    "removed %d incomplete checkpoint(s) in %s (a save cut off): %s",
                    len(removed),
                    self.root,
                    ", ".join(removed),
                )
            # a warning now if keep_last + 1 do not fit
            ckpt.room(self.engine, self.root, self.keep_last)
        return state

    def save(self, state: RunState) -> None:
        """The four parts: DeepSpeed's files (model, optimiser, lr schedule) with the run state
        and every rank's RNG states (all-gathered) in its client_state under "state" and "rng"
        (the keys every checkpoint has had), and the objective's per-rank state beside them."""
        rngs = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, rng_state())
        client = {"state": asdict(state), "rng": rngs}
        rank_state = self.objective.rank_state()
        ckpt.save_checkpoint(
            self.engine, self.root, state.step, client, self.keep_last, rank_state=rank_state
        )

    def restore(self, root: str | Path, tag: str, state: RunState) -> None:
        """Every rank: the four parts of ``root/tag`` loaded for this run's layout (the marker's
        record against this run's), the run state into ``state``."""
        saved, rank, world = ckpt.saved_layout(root, tag), dist.get_rank(), dist.get_world_size()
        same, stage = saved.get("world_size", world) == world, self.engine.zero_optimization_stage()
        # the engine: another world size re-partitioned (mpp.checkpoint.elastic); stage 0 is whole
        if same or stage == 0:
            with ckpt.weights_only_loads():  # a checkpoint is untrusted input
                _, client = self.engine.load_checkpoint(str(root), tag=tag)
        else:
            client = elastic.load_universal(self.engine, Path(root), tag)
        # the run state: an epoch's order does not depend on the world size (mpp.data.order), so
        # the step in the epoch carries over; the micro-batch count is rescaled to this accumulation
        for key, value in asdict(RunState(**client["state"])).items():
            setattr(state, key, value)
        accum, now = saved.get("grad_accum", self.plan.grad_accum), self.plan.grad_accum
        if accum != now or not same:
            state.batch_in_epoch = math.ceil(state.batch_in_epoch / accum) * now
        # per-rank RNG streams cannot carry over to other ranks: re-derived from (seed, rank, step)
        if same:
            set_rng_state(client["rng"][rank])
        else:
            seed_everything(self.seed + rank + 1_000_003 * state.step)
        # the objective's per-rank state (HPM's fp32 EMA under bf16: whole below ZeRO-3, a shard
        # at 3, dropped on another world size)
        rank_state = ckpt.load_rank_state(root, tag)
        if not same and stage == 3:
            if rank_state and rank == 0:
                log.warning(
                    "elastic resume: the per-rank state of %s/%s (HPM's fp32 EMA) is ZeRO-3 shards of another "
                    "world size: it restarts from the weights",
                    root,
                    tag,
                )
            rank_state = {}
        self.objective.load_rank_state(rank_state)
        if rank == 0 and not same:
            log.info(
                "elastic resume: %s/%s written by %d rank(s) (micro batch %s), now %d (micro batch %d); "
                "the epoch continues at step %d",
                root,
                tag,
                saved["world_size"],
                saved.get("micro_batch"),
                world,
                self.plan.micro_batch,
                state.step,
            )

    def restore_intact(self, state: RunState) -> str | None:
        """The newest intact checkpoint loaded into ``state`` (maybe a resume's layout): its tag,
        or None when there is none to go back to (``mpp.train.nonfinite.roll_back``)."""
        found = resolve_on_rank0("auto", self.root)
        if not isinstance(found, tuple):  # none, or none intact: nothing to go back to
            return None
        self.restore(*found, state)
        return found[1]

    def export_encoder(self, cfg: RunConfig) -> None:
        """fp32 ``encoder.safetensors`` for downstream: from the final checkpoint (ZeRO, bf16) or
        the module itself (fp32, stage 0), with ``cfg``'s architecture in its metadata and
        ``cfg`` beside it (encoder_config.json)."""
        sd = ckpt.full_state_dict(self.engine, self.root, ckpt.latest_complete(self.root))
        if dist.get_rank() == 0:
            model = self.objective
            # hpm: base.encoder.
            prefix = next(n for n, m in model.named_modules() if m is model.encoder) + "."
            out = self.run_dir / "encoder.safetensors"
            export_encoder(sd, encoder_kwargs(cfg, model.encoder), out, prefix=prefix)
            save_config(cfg, self.run_dir / "encoder_config.json")
        dist.barrier()


def resolve_on_rank0(resume: str | None, ckpt_root: Path) -> tuple[str, str] | str | None:
    """``ckpt.resolve_resume`` on rank 0 (files checked), learned by every rank: (root, tag),
    None, or the problem as a line."""
    found = None
    if dist.get_rank() == 0:
        try:
            found = ckpt.resolve_resume(resume, ckpt_root)
        except (FileNotFoundError, ckpt.CheckpointError) as e:
            found = str(e)  # every rank must learn it, not wait in the broadcast
    return from_rank0(found)


def encoder_kwargs(cfg: RunConfig, encoder: torch.nn.Module) -> dict:
    """The encoder as built (``VisionTransformer.architecture``: what the weights it started from
    stated too), with the config's variant name, attention and stochastic depth."""
    return {"name": cfg.model.name, **cfg.model.vit_kwargs(), **encoder.architecture()}
