"""The optimiser and its schedule: parameter groups (weight decay, layer-wise lr decay), torch's
fused Adam/AdamW, warm-up + cosine per iteration (docs/ARCHITECTURE.md §4.6, §5.1)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mpp.config import RunConfig


def param_groups(
    model: torch.nn.Module, weight_decay: float, lr_scale_of: Callable[[str], float] | None = None
) -> list[dict[str, Any]]:
    """Trainable parameters grouped by (weight decay, lr scale). No decay on biases, norms
    (any 1-D tensor) and the model's ``no_weight_decay()`` names (position embeddings, tokens)."""
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    groups: dict[tuple[float, float], dict[str, Any]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = 0.0 if p.ndim <= 1 or name.endswith(".bias") or name in skip else weight_decay
        scale = lr_scale_of(name) if lr_scale_of else 1.0
        group = groups.setdefault(
            (decay, scale), {"params": [], "weight_decay": decay, "lr_scale": scale}
        )
        group["params"].append(p)
    return list(groups.values())


PAPER_OPTIMIZER = {"mpp": "adam", "mae": "adamw", "hpm": "adamw"}  # ViT paper: Adam; MAE/HPM: AdamW


def build_optimizer(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The configured Adam/AdamW over ``model``'s groups, layer-wise lr decay included
    (``optim.layer_decay`` < 1, over the blocks of ``model.encoder``)."""
    o = cfg.optim
    objective = getattr(cfg, "objective", None)  # fine-tuning has none: AdamW
    name = o.name or PAPER_OPTIMIZER.get(objective.name if objective else "", "adamw")
    lr_scale_of = None
    if o.layer_decay < 1.0:
        lr_scale_of = layer_decay_scale(len(model.encoder.blocks), o.layer_decay)
    groups = param_groups(model, o.weight_decay, lr_scale_of)
    return adam(name, groups, peak_lr(cfg), o.betas, o.eps)


def adam(
    name: str,
    groups: list[dict],
    lr: float,
    betas: tuple[float, float] | None = None,
    eps: float = 1e-8,
) -> torch.optim.Optimizer:
    """torch's Adam ("adam": L2-style decay, as the ViT paper's Adam with weight decay) or
    AdamW, betas by default the paper's: (0.9, 0.999) for Adam, (0.9, 0.95) for AdamW (MAE).
    Fused kernels on CPU and CUDA: one pass over each group instead of ~8 foreach ops
    (docs/ARCHITECTURE.md §6.3)."""
    betas = betas or ((0.9, 0.999) if name == "adam" else (0.9, 0.95))
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return cls(groups, lr=lr, betas=betas, eps=eps, fused=True)


def peak_lr(cfg: RunConfig) -> float:
    """Absolute lr, or MAE's linear scaling rule: blr x global batch / 256."""
    return cfg.optim.lr if cfg.optim.lr is not None else cfg.optim.blr * cfg.train.batch_size / 256


def lr_at(step: int, *, peak: float, total: int, warmup: int, min_lr: float = 0.0) -> float:
    """Linear warm-up from 0, then half-cosine to ``min_lr`` (MAE's per-iteration schedule)."""
    if step < warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Schedule:
    """The run's lr: linear warm-up to ``peak``, cosine to ``min_lr`` at ``total`` steps, times
    the rollback scale the run state carries (``train.on_nonfinite=rollback``)."""

    peak: float
    warmup: int
    total: int
    min_lr: float = 0.0

    @classmethod
    def of(cls, cfg: RunConfig, plan: Any) -> Schedule:
        return cls(peak_lr(cfg), plan.warmup_steps, plan.total_steps, cfg.optim.min_lr)

    def apply(self, optimizer: torch.optim.Optimizer, state: Any) -> float:
        """Set (and return) the lr of the step ``state`` is about to take."""
        lr = lr_at(
            state.step, peak=self.peak, total=self.total, warmup=self.warmup, min_lr=self.min_lr
        )
        lr *= state.lr_scale
        set_lr(optimizer, lr)
        return lr


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Per-group lr = lr x lr_scale, on the engine's optimiser (DeepSpeed schedulers would
    flatten the per-group scales)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def layer_id(name: str, depth: int) -> int:
    """BEiT/MAE layer ids of an encoder parameter (any prefix up to ``encoder.``): embeddings 0,
    block i -> i + 1, everything after the blocks (and outside the encoder) depth + 1."""
    name = name.split("encoder.", 1)[-1]
    if name.startswith(("cls_token", "pos_embed", "patch_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def layer_decay_scale(depth: int, decay: float) -> Callable[[str], float]:
    """lr_scale_of(name) = decay^(depth + 1 - layer_id): block i gets decay^(depth - i)."""
    return lambda name: decay ** (depth + 1 - layer_id(name, depth))
