"""Loading a checkpoint into this run, whatever world size, micro batch or accumulation wrote it
(the global batch stays: ``mpp.plan.check_resume``).

- Weights and optimiser: a ZeRO-1/2/3 checkpoint written by another world size goes through
  DeepSpeed's universal checkpoint (``ds_to_universal`` on rank 0, then a load with
  ``load_universal``), which re-partitions the fp32 masters and Adam moments; a stage-0
  checkpoint holds them whole and loads directly.
- The data position: an epoch's order does not depend on the world size (``mpp.data.order``),
  so the step in the epoch carries over; the micro-batch count is rescaled to this run's
  accumulation.
- RNG: per-rank streams cannot carry over to other ranks; they are re-derived from
  (seed, rank, step), so a given layout resumes the same way every time.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mpp.parallel.distributed import from_rank0
from mpp.train import checkpoint as ckpt
from mpp.train.plan import Plan, RunState
from mpp.train.rng import seed_everything, set_rng_state

log = logging.getLogger("mpp.elastic")
UNIVERSAL = "universal"  # RUN/checkpoints/universal/TAG: a conversion, removed once loaded


def restore(engine: Any, objective: torch.nn.Module, root: str | Path, tag: str, plan: Plan, seed: int) -> RunState:
    """Every rank: the checkpoint's weights, optimiser, run state and RNG, for this run's layout."""
    saved = ckpt.saved_layout(root, tag)
    world, rank = dist.get_world_size(), dist.get_rank()
    same = saved.get("world_size", world) == world
    if same or engine.zero_optimization_stage() == 0:
        with ckpt.weights_only_loads():  # a checkpoint is untrusted input
            _, client = engine.load_checkpoint(str(root), tag=tag)
    else:
        client = _load_universal(engine, Path(root), tag, saved["world_size"])
    state = RunState(**client["state"])
    accum = saved.get("grad_accum", plan.grad_accum)
    if accum != plan.grad_accum or not same:  # the step in the epoch carries over, in this run's micro-batches
        state.batch_in_epoch = math.ceil(state.batch_in_epoch / accum) * plan.grad_accum
    if same:
        set_rng_state(client["rng"][rank])
    else:
        seed_everything(seed + rank + 1_000_003 * state.step)
    rank_state = ckpt.load_rank_state(root, tag)  # HPM's fp32 EMA under bf16: whole below ZeRO-3, a shard at 3
    if not same and engine.zero_optimization_stage() == 3:
        if rank_state and rank == 0:
            log.warning("elastic resume: the per-rank state of %s/%s (HPM's fp32 EMA) is ZeRO-3 shards of another "
                        "world size: it restarts from the weights", root, tag)  # fmt: skip
        rank_state = {}
    objective.load_rank_state(rank_state)
    if rank == 0 and not same:
        log.info("elastic resume: %s/%s written by %d rank(s) (micro batch %s), now %d (micro batch %d); "
                 "the epoch continues at step %d", root, tag, saved["world_size"], saved.get("micro_batch"),
                 world, plan.micro_batch, state.step)  # fmt: skip
    return state


def _load_universal(engine: Any, root: Path, tag: str, saved_world: int) -> dict:
    """Convert ``root/tag`` for another world size (rank 0), load it on every rank, remove the copy."""
    out = root / UNIVERSAL
    problem = _convert(root / tag, out / tag) if dist.get_rank() == 0 else None
    problem = from_rank0(problem)
    if problem:
        raise RuntimeError(problem)
    groups = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in engine.optimizer.param_groups]
    engine._config.load_universal_checkpoint = True  # this load only: a rollback later reads our own checkpoints
    try:
        with ckpt.weights_only_loads():
            _, client = engine.load_checkpoint(str(out), tag=tag)
    finally:
        engine._config.load_universal_checkpoint = False
    # DeepSpeed's ZeRO-3 universal load copies group 0's settings (weight decay, lr_scale) into
    # every group (they come from the config: this run's own go back), and gives every sub-group
    # one shared `step` tensor, which Adam would then advance once per sub-group
    for group, settings in zip(engine.optimizer.param_groups, groups, strict=True):
        group.update(settings)
    for state in engine.optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    _restore_frozen(engine, root, tag)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
    if client is None:
        raise RuntimeError(f"{root}/{tag}: the universal checkpoint did not load")
    return client


def _restore_frozen(engine: Any, root: Path, tag: str) -> None:
    """A universal load restores trained parameters only: frozen ones (HPM's EMA teacher, fixed
    tables) come from the checkpoint's fp32 weights, read on rank 0 and written on every rank."""
    import deepspeed

    frozen = [(n, p) for n, p in engine.module.named_parameters() if not p.requires_grad]
    if not frozen:
        return
    rank, stage3 = dist.get_rank(), engine.zero_optimization_stage() == 3
    weights = ckpt.zero_to_fp32(root, tag) if rank == 0 else None
    with deepspeed.zero.GatheredParameters([p for _, p in frozen], modifier_rank=0, enabled=stage3), torch.no_grad():
        for name, param in frozen:
            if rank == 0 and name in weights:
                param.data.copy_(weights[name].to(param.dtype))
            if not stage3:
                dist.broadcast(param.data, 0)


def _convert(src: Path, dst: Path) -> str | None:
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    shutil.rmtree(dst, ignore_errors=True)
    args = argparse.Namespace(input_folder=str(src), output_folder=str(dst), num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True)  # fmt: skip
    try:
        with ckpt.weights_only_loads():
            ds_to_universal(args)
    except Exception as e:  # every rank must learn it, not wait in the broadcast
        return f"cannot re-partition {src} for this world size (DeepSpeed's ds_to_universal): {e!r}"
    return None
