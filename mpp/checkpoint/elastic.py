"""Resuming on another world size (elastic resume): a ZeRO-1/2/3 checkpoint is partitioned per
rank, so rank 0 converts it into DeepSpeed's universal checkpoint (``ds_to_universal``, into
``RUN/checkpoints/universal/TAG``, removed once loaded) and every rank loads that with
``load_universal_checkpoint``, which re-partitions the fp32 masters and Adam moments; then what
that load gets wrong in DeepSpeed 0.19.8 is put right (docs/ARCHITECTURE.md §5.2). A stage-0
checkpoint holds everything whole and loads directly (``Checkpointer.restore``)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mpp.checkpoint import format as ckpt
from mpp.parallel.distributed import from_rank0

UNIVERSAL = "universal"  # RUN/checkpoints/universal/TAG: a conversion, removed once loaded


def load_universal(engine: Any, root: Path, tag: str) -> dict:
    """Convert ``root/tag`` for another world size (rank 0), load it on every rank, remove the copy."""
    out = root / UNIVERSAL
    problem = _convert(root / tag, out / tag) if dist.get_rank() == 0 else None
    problem = from_rank0(problem)
    if problem:
        raise RuntimeError(problem)
    groups = [
        {k: v for k, v in g.items() if k not in ("params", "step")}
        for g in engine.optimizer.param_groups
    ]
    # this load only: a rollback later reads our own checkpoints
    engine._config.load_universal_checkpoint = True
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
    with (
        deepspeed.zero.GatheredParameters([p for _, p in frozen], modifier_rank=0, enabled=stage3),
        torch.no_grad(),
    ):
        for name, param in frozen:
            if rank == 0 and name in weights:
                param.data.copy_(weights[name].to(param.dtype))
            if not stage3:
                dist.broadcast(param.data, 0)


def _convert(src: Path, dst: Path) -> str | None:
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    shutil.rmtree(dst, ignore_errors=True)
    args = argparse.Namespace(
        input_folder=str(src),
        output_folder=str(dst),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    try:
        with ckpt.weights_only_loads():
            ds_to_universal(args)
    except Exception as e:  # every rank must learn it, not wait in the broadcast
        return f"cannot re-partition {src} for this world size (DeepSpeed's ds_to_universal): {e!r}"
    return None
