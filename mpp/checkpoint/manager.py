"""The ``Checkpointer``: a run's checkpoints saved, resumed, rolled back to, and its final
``encoder.safetensors``. What a checkpoint holds is one declared mapping, ``Checkpointer.states``
(torchtitan's idea), saved and loaded by one loop: a new part is one ``Stateful`` entry
(docs/ARCHITECTURE.md §5.2). ``restore`` loads a checkpoint into this run whatever world size,
micro batch or accumulation wrote it (the global batch stays: ``mpp.train.plan.check_resume``):
each entry is told how the layout changed (``Loading``) and loads its part for this one.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from mpp.checkpoint import elastic
from mpp.checkpoint import format as ckpt
from mpp.checkpoint.state import RunState, rng_state, seed_everything, set_rng_state
from mpp.config import RunConfig, save_config
from mpp.hub.encoder_file import export_encoder
from mpp.parallel.distributed import from_rank0

log = logging.getLogger(__name__)

# where an entry's part lives: DeepSpeed's own files, and rank_state_RANK.safetensors; any other
# key is a key of DeepSpeed's client_state
ENGINE, RANK_STATE = "engine", "rank_state"


@dataclass
class Loading:
    """A checkpoint being loaded, as each ``Stateful`` entry is told it: where, the layout that
    wrote it (``saved``, the ``COMPLETE`` marker: step, world size, accumulation) against this
    run's ``plan``, the seed and this rank."""

    root: str | Path
    tag: str
    plan: Any  # this run's mpp.train.plan.Plan (its micro_batch and grad_accum)
    seed: int
    rank: int = field(default_factory=dist.get_rank)
    # DeepSpeed's client_state, read with the engine's files by its entry (the first)
    client: dict = field(default_factory=dict)
    saved: dict = field(init=False)
    same: bool = field(init=False)

    def __post_init__(self) -> None:
        self.saved = ckpt.saved_layout(self.root, self.tag)
        world = dist.get_world_size()
        self.same = self.saved.get("world_size", world) == world

    def part(self, key: str) -> Any:
        """The saved part of the entry ``key`` (the engine's entry reads its own)."""
        if key == RANK_STATE:
            return ckpt.load_rank_state(self.root, self.tag)
        return None if key == ENGINE else self.client[key]


class Stateful(Protocol):
    """An entry of ``Checkpointer.states``: its part of a checkpoint, and that part loaded back
    into this run, told how the layout changed."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, sd: Any, at: Loading) -> None: ...


@dataclass
class EngineEntry:
    """DeepSpeed's model, optimiser and lr schedule, in DeepSpeed's files (``engine.save_checkpoint``
    in ``mpp.checkpoint.format.save_checkpoint``) with the client_state; another world size
    through ``mpp.checkpoint.elastic``."""

    engine: Any

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, sd: None, at: Loading) -> None:
        if at.same or self.engine.zero_optimization_stage() == 0:
            # a checkpoint is untrusted input
            with ckpt.weights_only_loads():
                _, at.client = self.engine.load_checkpoint(str(at.root), tag=at.tag)
        else:
            at.client = elastic.load_universal(self.engine, Path(at.root), at.tag)


@dataclass
class RunStateEntry:
    """The ``RunState`` (step, data position, counters), loaded in place. An epoch's order does not
    depend on the world size (``mpp.data.order``), so the step in the epoch carries over; the
    micro-batch count is rescaled to this run's accumulation."""

    state: RunState

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, sd: dict, at: Loading) -> None:
        for key, value in asdict(RunState(**sd)).items():
            setattr(self.state, key, value)
        accum, now = at.saved.get("grad_accum", at.plan.grad_accum), at.plan.grad_accum
        if accum != now or not at.same:
            self.state.batch_in_epoch = math.ceil(self.state.batch_in_epoch / accum) * now


@dataclass
class RngEntry:
    """Every rank's RNG states (all-gathered). Per-rank streams cannot carry over to other ranks:
    another world size re-derives them from (seed, rank, step), the same way every time; the step
    is the run state's, loaded before this entry."""

    state: RunState

    def state_dict(self) -> list:
        rngs = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, rng_state())
        return rngs

    def load_state_dict(self, sd: list, at: Loading) -> None:
        if at.same:
            set_rng_state(sd[at.rank])
        else:
            seed_everything(at.seed + at.rank + 1_000_003 * self.state.step)


@dataclass
class RankStateEntry:
    """The objective's per-rank state (HPM's fp32 EMA under bf16: whole below ZeRO-3, a shard at 3,
    dropped on another world size)."""

    engine: Any

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.engine.module.rank_state()

    def load_state_dict(self, sd: dict[str, torch.Tensor], at: Loading) -> None:
        if not at.same and self.engine.zero_optimization_stage() == 3:
            if sd and at.rank == 0:
                log.warning(
                    "elastic resume: the per-rank state of %s/%s (HPM's fp32 EMA) is ZeRO-3 shards of another "
                    "world size: it restarts from the weights",
                    at.root,
                    at.tag,
                )
            sd = {}
        self.engine.module.load_rank_state(sd)


class Checkpointer:
    """``RUN/checkpoints``: a complete checkpoint every ``train.ckpt_every`` steps and at the end
    (``keep_last`` kept), on a stop signal, and the final encoder. Every rank calls every method."""

    def __init__(
        self, engine: Any, run_dir: Path, plan: Any, keep_last: int, interval: int, seed: int
    ) -> None:
        self.engine, self.objective, self.run_dir = engine, engine.module, run_dir
        self.plan, self.root = plan, run_dir / "checkpoints"
        self.keep_last, self.interval, self.seed = keep_last, interval, seed

    def states(self, state: RunState) -> dict[str, Stateful]:
        """What a checkpoint holds, one entry each, saved and loaded in this order (the engine
        first: its files carry the client_state), ``state`` the run state saved or loaded into.
        The keys of an entry in the client_state are those of checkpoints before the mapping."""
        return {
            ENGINE: EngineEntry(self.engine),
            "state": RunStateEntry(state),
            "rng": RngEntry(state),
            RANK_STATE: RankStateEntry(self.engine),
        }

    def resume(self, spec: str | None) -> RunState:
        """The run state to start from: ``spec`` (None, "auto" or a path) resolved on rank 0 to the
        newest intact checkpoint, loaded for this layout; a fresh state when there is none."""
        state = RunState()
        found = from_rank0(resolve_on_rank0(spec, self.root))
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
        client = {key: entry.state_dict() for key, entry in self.states(state).items()}
        rank_state = client.pop(RANK_STATE)
        # DeepSpeed writes its own
        del client[ENGINE]
        ckpt.save_checkpoint(
            self.engine, self.root, state.step, client, self.keep_last, rank_state=rank_state
        )

    def restore(self, root: str | Path, tag: str, state: RunState) -> None:
        """Every rank: every entry of ``states`` loaded from ``root/tag`` for this run's layout,
        the run state into ``state``."""
        at = Loading(root, tag, self.plan, self.seed)
        for key, entry in self.states(state).items():
            entry.load_state_dict(at.part(key), at)
        if at.rank == 0 and not at.same:
            log.info(
                "elastic resume: %s/%s written by %d rank(s) (micro batch %s), now %d (micro batch %d); "
                "the epoch continues at step %d",
                root,
                tag,
                at.saved["world_size"],
                at.saved.get("micro_batch"),
                dist.get_world_size(),
                self.plan.micro_batch,
                state.step,
            )

    def maybe_save(self, state: RunState, stop: int) -> bool:
        """After an optimiser step; whether a checkpoint was due (and written)."""
        due = state.step % self.interval == 0 or state.step == stop
        if due:
            self.save(state)
        return due

    def restore_intact(self, state: RunState) -> str | None:
        """The newest intact checkpoint loaded into ``state`` (maybe a resume's layout): its tag,
        or None when there is none to go back to (``mpp.train.nonfinite.roll_back``)."""
        found = from_rank0(resolve_on_rank0("auto", self.root))
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
    """Rank 0: the checkpoint to resume from, (root, tag), None, or the problem as a line."""
    if dist.get_rank() != 0:
        return None
    try:
        return ckpt.resolve_resume(resume, ckpt_root)  # the newest intact checkpoint: files checked
    except (FileNotFoundError, ckpt.CheckpointError) as e:
        return str(e)  # every rank must learn it, not wait in the broadcast


def encoder_kwargs(cfg: RunConfig, encoder: torch.nn.Module) -> dict:
    """The encoder as built (``VisionTransformer.architecture``: what the weights it started from
    stated too), with the config's variant name, attention and stochastic depth."""
    return {"name": cfg.model.name, **cfg.model.vit_kwargs(), **encoder.architecture()}
