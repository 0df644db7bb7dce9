"""Fine-tuning's batch augmentations on the device, timm's recipe: label smoothing, mixup / cutmix,
random erasing (docs/ARCHITECTURE.md §4.6)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def soft_targets(labels: Tensor, num_classes: int, smoothing: float) -> Tensor:
    """One-hot (B, C) with label smoothing: 1 - s + s/C on the label, s/C elsewhere."""
    off = smoothing / num_classes
    return torch.full((labels.shape[0], num_classes), off, device=labels.device).scatter_(
        1, labels.unsqueeze(1), 1.0 - smoothing + off
    )


def mixup_cutmix(
    images: Tensor,
    targets: Tensor,
    mixup: float,
    cutmix: float,
    prob: float = 1.0,
    switch_prob: float = 0.5,
) -> tuple[Tensor, Tensor, float]:
    """timm's batch-mode Mixup: with probability ``prob`` mix each image with the batch's
    flipped order, by a Beta(a, a) weight (mixup) or a box of that area (cutmix, weight
    corrected to the box actually cut). Returns (images, soft targets, lam)."""
    if (mixup <= 0 and cutmix <= 0) or torch.rand(()).item() >= prob:
        return images, targets, 1.0
    use_cutmix = cutmix > 0 and (mixup <= 0 or torch.rand(()).item() < switch_prob)
    alpha = cutmix if use_cutmix else mixup
    lam = float(torch.distributions.Beta(alpha, alpha).sample())
    flipped = images.flip(0)
    if use_cutmix:
        H, W = images.shape[-2:]
        cut_h, cut_w = int(H * math.sqrt(1 - lam)), int(W * math.sqrt(1 - lam))
        cy, cx = int(torch.randint(H, ())), int(torch.randint(W, ()))
        y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, H)
        x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, W)
        images = images.clone()
        images[..., y0:y1, x0:x1] = flipped[..., y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / (H * W)
    else:
        images = images * lam + flipped * (1.0 - lam)
    return images, targets * lam + targets.flip(0) * (1.0 - lam), lam


def random_erasing(
    images: Tensor, prob: float, area=(0.02, 1 / 3), aspect=(0.3, 1 / 0.3)
) -> Tensor:
    """timm's RandomErasing (mode 'pixel'), batched: each image, with probability ``prob``,
    gets one box of N(0, 1) noise (in normalised space), area and aspect drawn per image."""
    if prob <= 0:
        return images
    B, _, H, W = images.shape
    dev = images.device
    erase = torch.rand(B, device=dev) < prob
    target = torch.empty(B, device=dev).uniform_(*area) * H * W
    aspect = torch.exp(
        torch.empty(B, device=dev).uniform_(math.log(aspect[0]), math.log(aspect[1]))
    )
    h = torch.sqrt(target * aspect).round().clamp(1, H)
    w = torch.sqrt(target / aspect).round().clamp(1, W)
    top = (torch.rand(B, device=dev) * (H - h + 1)).floor()
    left = (torch.rand(B, device=dev) * (W - w + 1)).floor()
    ys = torch.arange(H, device=dev).view(1, H, 1)
    xs = torch.arange(W, device=dev).view(1, 1, W)
    box = (
        (ys >= top.view(B, 1, 1))
        & (ys < (top + h).view(B, 1, 1))
        & (xs >= left.view(B, 1, 1))
        & (xs < (left + w).view(B, 1, 1))
    )
    box &= erase.view(B, 1, 1)
    return torch.where(box.unsqueeze(1), torch.randn_like(images), images)
