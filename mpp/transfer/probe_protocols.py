"""The linear probes of the papers, beside ``fast`` (mpp.transfer.probe: cached center-crop features + SGD).

- ``mae``: MAE's main_linprobe.py. BatchNorm1d(affine=False, eps=1e-6) + Linear on the cls
  token, LARS (weight decay 0, momentum 0.9, trust coefficient 0.001), lr = blr x batch / 256
  (blr 0.1, batch 16384), 10 warm-up epochs of 90, and the training images augmented on the fly
  (RandomResizedCrop at torchvision's default scale + flip) through the frozen encoder: no cache.
- ``dinov2``: DINOv2's eval/linear.py. Linear heads (no BatchNorm) on the cls tokens of the last
  n blocks, n in {1, 4}, alone or with the last block's average-pooled patch tokens concatenated,
  times a grid of 13 learning rates (each x batch / 256), SGD momentum 0.9, cosine with no
  warm-up; all heads trained in one pass over cached features, the best chosen on a held-out
  split of train, its top-1 reported on val. (DINOv2 augments on the fly and picks on its val
  set; here the cache decides the first, the issue the second.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from mpp.features import FeatureSpec, Slot, end_every_rank
from mpp.models.vit import VisionTransformer
from mpp.transfer.probe import (
    HeadTrainer,
    LinearHead,
    Probe,
    scaled_lr,
    train_on_features,
)

if TYPE_CHECKING:
    from mpp.config import ProbeSection

# main_linprobe.py: RandomResizedCrop(224, interpolation=3), at torchvision's default scale
MAE_CROP_SCALE = (0.08, 1.0)
# eval/linear.py --learning-rates; each scaled by batch / 256
DINOV2_LRS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 1e-1)
DINOV2_N_LAST_BLOCKS = (1, 4)  # n_last_blocks_list
DINOV2_AVGPOOL = (False, True)  # avgpools_choices
MAX_MICRO_BATCH = 1024  # images per loader batch of the MAE stream; a step accumulates several


# ---- MAE: LARS on augmented images through the frozen encoder ---------------------------------


def mae_heads(slots: list[Slot], dim: int, num_classes: int, lr: float, seed: int) -> list[Probe]:
    """A BatchNorm + Linear head per slot (one: the cls token of the last block), each from ``seed``."""
    return [
        Probe(
            [i], lr, LinearHead(dim, num_classes, torch.Generator().manual_seed(seed)), {"block": b}
        )
        for i, (b, _) in enumerate(slots)
    ]


def micro_batches(per_rank: int) -> int:
    """The fewest loader batches of at most MAX_MICRO_BATCH that split a rank's share of a step evenly."""
    accum = -(-per_rank // MAX_MICRO_BATCH)
    while per_rank % accum:
        accum += 1
    return accum


def _gather_rows(
    x: Tensor | None, failed: Exception | None = None, device: torch.device | None = None
) -> Tensor | None:
    """Every rank's rows, in rank order (ranks may hold different counts: a skipped bad sample).
    ``failed``: this rank's stream raised it (``x`` None, the rows' ``device`` given): it says so
    in the count, and every rank ends with it (``end_every_rank``) instead of waiting here."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    world, device = dist.get_world_size(), x.device if x is not None else device
    counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([-1 if x is None else x.shape[0]], device=device))
    if x is None or min(int(c.item()) for c in counts) < 0:
        end_every_rank(failed, world)  # the others raise the failing rank's error
        return None
    longest = int(max(c.item() for c in counts))
    padded = torch.zeros(longest, *x.shape[1:], dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(c.item())] for p, c in zip(parts, counts, strict=True)])


def mae_probe(
    encoder: VisionTransformer,
    loader,
    trainer: HeadTrainer,
    val: tuple[Tensor, Tensor],
    *,
    epochs: int,
    accum: int,
    features: FeatureSpec,
) -> dict:
    """Train ``trainer``'s heads for ``epochs`` passes of the augmented training stream (each
    step the ``features`` of ``accum`` loader batches on every rank, gathered: every rank takes
    the same step), evaluating on the cached ``val`` features after each epoch (MAE reports the
    max)."""
    encoder.eval()
    device = next(encoder.parameters()).device
    history = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        feats, labels, batches = [], [], iter(loader)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            except Exception as e:  # a DataError on this rank: every rank ends, none left waiting
                _gather_rows(None, e, device)
                raise
            feats.append(features.pool(encoder, batch["image"]))
            labels.append(batch["label"].to(device))
            if len(feats) == accum:
                trainer.step(_gather_rows(torch.cat(feats)), _gather_rows(torch.cat(labels)))
                feats, labels = [], []
        history.append(trainer.evaluate(*val))
    per_head = [[epoch[i]["top1"] for epoch in history] for i in range(len(trainer.probes))]
    return {
        "last": history[-1],
        "max_top1": [max(h) for h in per_head],
        "train_loss": trainer.last_losses.tolist(),
    }


# ---- DINOv2: a grid of heads in one pass over cached features ----------------------------------


def dinov2_slots(depth: int) -> list[Slot]:
    """The cls token of each of the last n_max blocks (in block order), then the last block's
    average-pooled patch tokens: every input of the grid."""
    n_max = min(max(DINOV2_N_LAST_BLOCKS), depth)
    return [(b, "token") for b in range(depth - n_max, depth)] + [(depth - 1, "avg")]


def dinov2_heads(depth: int, dim: int, num_classes: int, batch_size: int, seed: int) -> list[Probe]:
    """DINOv2's grid: n in {1, 4} (at most ``depth``) x avgpool x 13 lrs. Input: the cls tokens of
    the last n blocks concatenated, then the average-pooled patch tokens when avgpool, so
    (n + avgpool) x D wide (create_linear_input). Heads: Linear, weight N(0, 0.01), bias 0."""
    n_max = min(max(DINOV2_N_LAST_BLOCKS), depth)
    probes = []
    for n in sorted({min(n, depth) for n in DINOV2_N_LAST_BLOCKS}):
        for avgpool in DINOV2_AVGPOOL:
            slots = list(range(n_max - n, n_max)) + ([n_max] if avgpool else [])
            for lr in DINOV2_LRS:
                head = nn.Linear(len(slots) * dim, num_classes)
                nn.init.normal_(
                    head.weight, std=0.01, generator=torch.Generator().manual_seed(seed)
                )
                nn.init.zeros_(head.bias)
                facts = {"lr": lr, "n_blocks": n, "avgpool": avgpool}
                probes.append(Probe(slots, scaled_lr(lr, batch_size), head, facts))
    return probes


def holdout_split(n: int, fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """(fit indices, held-out indices): a seeded random ``fraction`` of ``n`` held out."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    held = max(1, round(fraction * n))
    return order[held:], order[:held]


def dinov2_probe(
    train: tuple[Tensor, Tensor],
    val: tuple[Tensor, Tensor],
    num_classes: int,
    *,
    depth: int,
    settings: ProbeSection,
    seed: int,
) -> dict:
    """Train the grid on the fit part of ``train`` (features (N, S, D) in ``dinov2_slots``
    order) for ``settings.epochs`` at ``settings.batch_size``, pick the head with the best
    held-out top-1 (the first on a tie), report its val top-1/top-5; ``grid`` lists every
    head's held-out and val top-1."""
    (x, y), batch_size = train, settings.batch_size
    fit, held = holdout_split(len(y), settings.holdout, seed)
    probes = dinov2_heads(depth, x.shape[2], num_classes, batch_size, seed)
    steps = max(1, -(-len(fit) // batch_size))
    trainer = HeadTrainer(
        probes,
        total_steps=settings.epochs * steps,
        warmup_steps=0,  # CosineAnnealingLR(max_iter, eta_min=0)
        momentum=settings.momentum,
        weight_decay=settings.weight_decay,
        device=y.device,
    )
    fit_x, fit_y = x[fit.to(x.device)], y[fit.to(y.device)]
    train_on_features(
        trainer, fit_x, fit_y, epochs=settings.epochs, batch_size=batch_size, seed=seed
    )
    on_held = trainer.evaluate(x[held.to(x.device)], y[held.to(y.device)])
    on_val = trainer.evaluate(*val)
    best = max(range(len(probes)), key=lambda i: (on_held[i]["top1"], -i))
    grid = [
        {**p.facts, "holdout_top1": h["top1"], "val_top1": v["top1"]}
        for p, h, v in zip(probes, on_held, on_val, strict=True)
    ]
    return {
        **on_val[best],
        "best": {**probes[best].facts, "holdout_top1": on_held[best]["top1"]},
        "num_holdout": len(held),
        "train_loss": trainer.last_losses[best].item(),
        "grid": grid,
    }
