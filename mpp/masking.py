"""Mask generators: one interface, batched on the device, exact counts.

A mask is a bool tensor (B, N), True = masked/corrupted, with exactly
``num_masked(N, ratio)`` True per sample (DESIGN.md §3), so visible tokens gather
into a dense (B, N_vis, D) without padding or host syncs.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
from torch import Tensor


def num_masked(num_patches: int, ratio: float) -> int:
    """round(ratio * N), halves rounded up (Python's round() rounds halves to even)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"mask ratio must be in [0, 1], got {ratio}")
    return int(math.floor(ratio * num_patches + 0.5))


def mask_indices(mask: Tensor, num_masked: int) -> tuple[Tensor, Tensor]:
    """Split an exact-count mask into (visible_idx (B, N_vis), masked_idx (B, N_mask)).

    A stable argsort of the 0/1 mask lists visible positions first, in ascending order,
    then masked ones; the caller's exact count makes the split a static slice (no host sync).
    """
    n_vis = mask.shape[1] - num_masked
    order = torch.argsort(mask.to(torch.int8), dim=1, stable=True)
    return order[:, :n_vis], order[:, n_vis:]


def topk_mask(scores: Tensor, k: int) -> Tensor:
    """Bool mask (B, N) with True at the k highest scores of each row."""
    mask = torch.zeros_like(scores, dtype=torch.bool)
    if k > 0:
        mask.scatter_(1, scores.topk(k, dim=1).indices, True)
    return mask


class MaskGenerator(ABC):
    """Makes (B, N) bool masks over a (H, W) patch grid with an exact masked count."""

    def __init__(self, grid_size: tuple[int, int], mask_ratio: float) -> None:
        self.grid_size = tuple(grid_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.mask_ratio = mask_ratio
        self.num_masked = num_masked(self.num_patches, mask_ratio)

    @abstractmethod
    def __call__(
        self, batch_size: int, device: torch.device | str = "cpu", generator: torch.Generator | None = None
    ) -> Tensor: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(grid={self.grid_size}, ratio={self.mask_ratio}, masked={self.num_masked})"


class RandomMask(MaskGenerator):
    """MAE's uniform random masking: the k lowest of per-sample uniform noise are masked."""

    def __call__(self, batch_size, device="cpu", generator=None):
        noise = torch.rand(batch_size, self.num_patches, device=device, generator=generator)
        return topk_mask(noise, self.num_masked)


MASK_GENERATORS: dict[str, type[MaskGenerator]] = {"random": RandomMask}


def build_mask_generator(strategy: str, grid_size: tuple[int, int], mask_ratio: float, **params) -> MaskGenerator:
    """Build a generator by name (``masking.strategy`` in the config)."""
    if strategy not in MASK_GENERATORS:
        raise ValueError(f"unknown masking strategy {strategy!r}; allowed: {sorted(MASK_GENERATORS)}")
    return MASK_GENERATORS[strategy](grid_size, mask_ratio, **params)
