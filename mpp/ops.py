"""Small tensor helpers shared by the data path, the objectives and the pictures: ImageNet
statistics, (un)normalising, patchify and its inverse, per-sample gathers (docs/ARCHITECTURE.md
§2.1, §7)."""

from __future__ import annotations

import functools

import torch
from einops import rearrange
from torch import Tensor

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def to_2tuple(size: int | tuple[int, int] | list[int], name: str = "size") -> tuple[int, int]:
    """``8`` -> (8, 8); a pair stays a pair; anything else is a ValueError naming ``name``."""
    pair = (size, size) if isinstance(size, int) else tuple(size)
    if len(pair) != 2 or not all(isinstance(s, int) and s > 0 for s in pair):
        raise ValueError(f"{name} must be a positive int or a pair of them, got {size!r}")
    return pair


def normalize(
    images: Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD, dtype: torch.dtype = torch.float32
) -> Tensor:
    """uint8 (B, C, H, W) -> ``dtype`` (x/255 - mean)/std, or float32 pixels already in [0, 1]
    (data that is not 8-bit) -> (x - mean)/std; computed on the tensor's own device."""
    scale = 255.0 if images.dtype == torch.uint8 else 1.0
    mean_t, std_t = _pixel_stats(tuple(mean), tuple(std), images.device, scale=scale)
    # out of place: a float input stays intact
    return (images.float() - mean_t).div_(std_t).to(dtype)


@functools.lru_cache(maxsize=32)
def _pixel_stats(
    mean: tuple[float, ...],
    std: tuple[float, ...],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    # made once per device: building them from Python lists every step is a blocking
    # host-to-device copy (normalising does it every step, and so do MPP's un-normalised targets)
    def as_tensor(v):
        return torch.tensor(v, dtype=dtype).mul_(scale).view(1, -1, 1, 1).to(device)

    return as_tensor(mean), as_tensor(std)


def unnormalize(images: Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """Normalised (B, C, H, W) -> raw pixels in [0, 1], snapped back to the uint8 grid: the inputs
    come from uint8 images, so snapping to k/255 makes the round trip exact and it cannot flip a
    colour bin at a boundary (a patch mean of exactly 2/8 is reachable with 256-pixel patches)."""
    m, s = _pixel_stats(tuple(mean), tuple(std), images.device, images.dtype)
    return ((images * s + m).clamp(0.0, 1.0) * 255.0).round() / 255.0


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """(B, C, H, W) -> (B, N, P*P*C), MAE's patch-pixel order (p, q, c)."""
    return rearrange(images, "b c (h p) (w q) -> b (h w) (p q c)", p=patch_size, q=patch_size)


def unpatchify(patches: Tensor, grid_size: tuple[int, int], patch_size: int) -> Tensor:
    """(B, N, P*P*C) in MAE's (p, q, c) order -> (B, C, H, W); the inverse of ``patchify``."""
    return rearrange(
        patches, "b (h w) (p q c) -> b c (h p) (w q)", h=grid_size[0], p=patch_size, q=patch_size
    )


def gather_tokens(x: Tensor, idx: Tensor) -> Tensor:
    """x (B, N, ...) at per-sample indices idx (B, n) -> (B, n, ...)."""
    return torch.gather(
        x, 1, idx.view(*idx.shape, *([1] * (x.ndim - 2))).expand(-1, -1, *x.shape[2:])
    )
