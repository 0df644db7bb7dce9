"""The lines a training run starts with (rank 0), as MAE's ``main_pretrain`` and timm's ``train.py``
print them: parameters, the effective batch, the lr and its source, the schedule in steps, the
data, how the step runs (docs/ARCHITECTURE.md §3.6)."""

from __future__ import annotations

import torch

from mpp.config import RunConfig
from mpp.train.optim import peak_lr
from mpp.train.plan import Plan


def run_summary(cfg: RunConfig, plan: Plan, model: torch.nn.Module, device: torch.device) -> str:
    """The start-of-run summary of ``cfg`` as ``plan`` resolved it, for ``model`` (the objective or
    the classifier, whole: before the engine partitions it) on ``device``; a few lines."""
    from mpp.train.trainer import resolve_compile

    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    encoder = sum(p.numel() for p in model.encoder.parameters())
    ranks = f"{plan.world_size} rank{'s' * (plan.world_size != 1)}"
    stop = min(plan.total_steps, cfg.train.stop_at_step or plan.total_steps)
    _, compiled = resolve_compile(cfg.model.compile, device, stop)
    d = cfg.data
    decode = "the GPU" if plan.stream.defer_jpeg else "the data workers"
    workers = f"{d.num_workers} worker{'s' * (d.num_workers != 1)} per rank"
    lines = [
        f"model: {cfg.model.name}, {trainable:,} trainable parameters of {total:,} "
        f"(encoder {encoder:,})",
        f"batch: {cfg.train.batch_size} = {plan.micro_batch} per rank x {plan.grad_accum} "
        f"accumulation x {ranks} ({device.type})",
        f"lr: {lr_derivation(cfg)}",
        f"schedule: {schedule_line(cfg, plan, stop)}",
        f"data: {data_line(plan)}",
        f"input: decoded by {decode} (data.decode={d.decode}), {workers}, "
        f"data.prefetch={d.prefetch}",
        f"step: {precision_of(cfg, device)}, ZeRO stage {cfg.zero_stage}, attention "
        f"{model.encoder.attention_backend(device)}, {compiled}",
    ]
    return "\n".join(["run:", *(f"  {line}" for line in lines)])


def lr_derivation(cfg: RunConfig) -> str:
    """The peak lr and how it follows from the config (``mpp.train.optim.peak_lr``), its decay."""
    o, lr = cfg.optim, peak_lr(cfg)
    if o.lr is not None:
        how = f"{lr:.4g} (optim.lr)"
    else:  # MAE's linear scaling rule
        how = f"{lr:.4g} = optim.blr {o.blr:.4g} x batch {cfg.train.batch_size} / 256"
    how += f", cosine to {o.min_lr:.4g}"
    if o.layer_decay < 1.0:
        how += f", layer decay {o.layer_decay}"
    return how + f", weight decay {o.weight_decay}"


def schedule_line(cfg: RunConfig, plan: Plan, stop: int) -> str:
    """Total, warm-up and per-epoch steps (and where train.stop_at_step ends this run)."""
    o = cfg.optim
    warm = "optim.warmup_steps" if o.warmup_steps is not None else "optim.warmup_epochs"
    line = (
        f"{plan.total_steps:,} steps ({plan.total_epochs:.4g} epochs of {plan.steps_per_epoch:,} "
        f"steps), {plan.warmup_steps:,} warm-up steps ({warm})"
    )
    lifted = getattr(plan, "epochs_steps", None)  # train.min_steps over train.epochs' steps
    if lifted is not None:
        line += f"; train.min_steps over the {lifted:,} of train.epochs"
    if stop < plan.total_steps:
        line += f", stopping at step {stop:,} (train.stop_at_step)"
    return line


def data_line(plan: Plan) -> str:
    """The samples of an epoch and the shards holding them (the census, or the labelled subset)."""
    if plan.census is not None:
        line = plan.census.summary()
    else:
        line = f"{plan.samples_per_epoch:,} labelled samples in {len(plan.train_shards)} shards"
    if plan.missing_shards:
        line += f"; {plan.missing_shards} shards not found"
    return line


def precision_of(cfg: RunConfig, device: torch.device) -> str:
    """train.precision as the engine runs it on ``device``."""
    resolved = cfg.resolved_precision(device.type)
    return resolved if cfg.train.precision == resolved else f"{resolved} (train.precision=auto)"
