"""One crop-resize-flip for a whole batch on the device (docs/ARCHITECTURE.md §3.4): each crop to
S x S as ``F.interpolate(mode="bicubic", antialias=True)`` resizes it (PIL's filter: Keys' cubic,
a = -0.5, its support widened by the downscale factor), in a number of kernels that does not grow
with the batch: a few groups of similar crop size, each one gather and two batched matmuls."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

# Groups of similar crop size, each padded to its largest crop: a fixed count keeps the number of
# kernels flat in B. Estimated peak transient bytes at B = 256 of 500 x 375 photographs (a quarter
# of them portrait), RandomResizedCrop's boxes to 224 (the largest group's uint8 and float32
# crops, its column weights and first matmul's output, and the (B, 3, 224, 224) float32 result):
# 0.45 GB in 4 groups (padded area 1.3-1.4x the crops'), 1.1-1.4 GB in one (2.0-2.5x); with one
# 3000 x 2000 photograph among them, one group would hold 12.7 GB and 4 still hold 0.5 GB.
GROUPS = 4
CUBIC_A = -0.5  # Keys (1981), as PIL and torch


def cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic convolution kernel, support [-2, 2]."""
    x = np.abs(x)
    near = ((CUBIC_A + 2) * x - (CUBIC_A + 3)) * x * x + 1
    far = ((CUBIC_A * x - 5 * CUBIC_A) * x + 8 * CUBIC_A) * x - 4 * CUBIC_A
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def resample_weights(lengths: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(n,) source lengths in whole pixels -> each output pixel's first source pixel (n, size)
    and its weights on that pixel and the K - 1 after it (n, size, K), zero past its window: the
    antialiased bicubic of torch's ``_compute_indices_min_size_weights_aa``
    (aten/src/ATen/native/cpu/UpSampleKernel.cpp) and PIL's ``precompute_coeffs``, in float64."""
    lengths = np.asarray(lengths, dtype=np.float64)[:, None]  # (n, 1)
    scale = lengths / size
    stretch = np.maximum(scale, 1.0)  # downscaling widens the filter: the antialiasing
    support = 2.0 * stretch
    center = scale * (np.arange(size) + 0.5)  # (n, S) in source pixels
    # C++'s truncating casts; the window clipped to the crop (torch crops first, then resizes)
    first = np.maximum(np.trunc(center - support + 0.5), 0.0)
    count = np.minimum(np.trunc(center + support + 0.5), lengths) - first
    taps = np.arange(int(count.max()))
    x = (first[..., None] + taps - center[..., None] + 0.5) / stretch[..., None]
    weights = np.where(taps < count[..., None], cubic(x), 0.0)
    weights /= weights.sum(-1, keepdims=True)
    return first.astype(np.int64), weights


def size_groups(heights: np.ndarray, widths: np.ndarray, groups: int = GROUPS) -> list[np.ndarray]:
    """Indices of ``min(groups, n)`` groups, each to be padded to its largest crop height and
    width, with the least padded area in all: sorted by long side, cut by dynamic programming
    (an outlier photograph gets a group of its own instead of widening one of many)."""
    n = len(heights)
    order = np.argsort(np.maximum(heights, widths), kind="stable")
    h, w = heights[order].astype(np.float64), widths[order].astype(np.float64)
    later = np.triu(np.ones((n, n), dtype=bool))  # [i, j]: j >= i
    hmax = np.maximum.accumulate(np.where(later, h, 0.0), axis=1)
    wmax = np.maximum.accumulate(np.where(later, w, 0.0), axis=1)
    count = np.arange(n)[None, :] - np.arange(n)[:, None] + 1
    cost = np.where(later, count * hmax * wmax, np.inf)  # [i, j]: images i..j as one group
    best, starts = cost[0], []  # best[j]: the least cost of images 0..j in the groups so far
    for _ in range(min(groups, n) - 1):
        total = best[:-1, None] + cost[1:]  # [i - 1, j]: 0..i-1 as before, then i..j
        starts.append(total.argmin(0) + 1)
        best = total.min(0)
        best[0] = np.inf  # one image cannot make two groups
    bounds, last = [n], n - 1
    for start in reversed(starts):
        bounds.append(int(start[last]))
        last = bounds[-1] - 1
    return np.split(order, bounds[::-1][:-1]) if len(bounds) > 1 else [order]


def crop_resize_flip(
    images: Sequence[Tensor], boxes: Sequence[Sequence[float]], flips: Sequence[bool], size: int
) -> Tensor:
    """Decoded (3, H_i, W_i) uint8 images, their (left, top, right, bottom) whole-pixel boxes
    (clipped to the image) and flips -> (n, 3, size, size) uint8 on their device: each box
    resized (bicubic, antialiased, rounded as torch rounds) and flipped, in kernels whose count
    does not depend on n (about 60). A black (3, 1, 1) image (nothing decoded it) stays black."""
    n = len(images)
    if n == 0:
        return torch.empty(0, 3, size, size, dtype=torch.uint8)
    device = images[0].device
    groups, width = plan(images, boxes, flips, size)
    ints = packed_copy([g[k] for g in groups for k in INTS], np.int64, device)
    floats = packed_copy([g[k] for g in groups for k in FLOATS], np.float32, device)
    # the images back to back, then zeros for the window view's overhang
    packed = torch.cat([*(image.reshape(-1) for image in images), images[0].new_zeros(width)])
    # window[a, b] = packed[a + b]: the crops are gathered by (row start, column) pairs without
    # materialising a (n, 3H, W) int64 index
    window = packed.as_strided((len(packed) - width, width), (1, 1))
    result = torch.empty(n, size, 3, size, device=device)  # (n, y, c, x); the groups cover n
    for g in range(len(groups)):
        rows, cols, x0, y0, places = ints[len(INTS) * g : len(INTS) * (g + 1)]
        wx, wy = floats[len(FLOATS) * g : len(FLOATS) * (g + 1)]
        result.index_copy_(0, places, resize_group(window, rows, cols, x0, wx, y0, wy))
    out = torch.empty(n, 3, size, size, dtype=torch.uint8, device=device)
    return out.copy_(result.round_().clamp_(0, 255).permute(0, 2, 1, 3))


INTS, FLOATS = ("rows", "cols", "x0", "y0", "places"), ("wx", "wy")


def plan(
    images: Sequence[Tensor], boxes: Sequence[Sequence[float]], flips: Sequence[bool], size: int
) -> tuple[list[dict[str, np.ndarray]], int]:
    """What the host decides: for each size group its members' ``places`` in the batch, its crop
    rows' first pixels in the packed images (``rows``, (n_g, 3H) in (row, channel) order) and
    column offsets (``cols``, (n_g, W)), and the resampling weights (``x0``, ``wx``, ``y0``,
    ``wy``, the flips folded into x's); and the widest crop."""
    shapes = np.array([image.shape[-2:] for image in images], dtype=np.int64).reshape(-1, 2)
    height, width = shapes[:, 0], shapes[:, 1]
    start = np.concatenate([[0], np.cumsum(3 * height * width)[:-1]])  # in the packed images
    box = np.asarray(boxes, dtype=np.float64).astype(np.int64)  # whole pixels, as int(v)
    left = np.clip(box[:, 0], 0, width - 1)  # within the image, at least one pixel
    top = np.clip(box[:, 1], 0, height - 1)
    crop_w = np.clip(box[:, 2], left + 1, width) - left
    crop_h = np.clip(box[:, 3], top + 1, height) - top
    flips = np.asarray(flips, dtype=bool)
    groups = []
    for places in size_groups(crop_h, crop_w):
        h, w = crop_h[places], crop_w[places]
        # padding rows and columns repeat the last (their weights are 0)
        r = np.minimum(np.arange(h.max())[None, :], h[:, None] - 1)  # (n_g, H)
        row = (top[places, None] + r) * width[places, None] + left[places, None]
        plane = (height * width)[places, None, None] * np.arange(3)  # channel offsets
        rows = start[places, None, None] + row[:, :, None] + plane  # (n_g, H, 3)
        cols = np.minimum(np.arange(w.max())[None, :], w[:, None] - 1)
        x0, wx = resample_weights(w, size)
        y0, wy = resample_weights(h, size)
        flip = flips[places]
        x0[flip], wx[flip] = x0[flip, ::-1], wx[flip, ::-1]  # the output columns reversed
        rows = rows.reshape(len(places), -1)
        groups.append(dict(rows=rows, cols=cols, x0=x0, y0=y0, places=places, wx=wx, wy=wy))
    return groups, int(crop_w.max())


def resize_group(
    window: Tensor, rows: Tensor, cols: Tensor, x0: Tensor, wx: Tensor, y0: Tensor, wy: Tensor
) -> Tensor:
    """One group: its crops gathered into (n, 3H, W) and resized along x by ``wx`` (first pixels
    ``x0``), then along y by ``wy`` (``y0``), as two bmms -> (n, S, 3, S) float32. The dense
    matrices do ~60x the filter taps' work, mostly times 0: 68 GFLOP per batch of 256 500 x 375
    photographs to 224 (estimated 1-2 ms of an H100's float32, not yet measured); on this 2-core
    machine 3-4x the per-image F.interpolate's time (0.56 s against 0.15 s for 64)."""
    n, size = x0.shape
    height, width = rows.shape[1] // 3, cols.shape[1]
    crops = window[rows[:, :, None], cols[:, None, :]].float()  # (n, H * 3, W)
    with exact_float32(crops.device):
        along_x = torch.bmm(crops, dense(x0, wx, width).transpose(1, 2))  # (n, H * 3, S)
        del crops
        along_y = torch.bmm(dense(y0, wy, height), along_x.view(n, height, 3 * size))
    return along_y.view(n, size, 3, size)  # (y, channel, x)


def dense(first: Tensor, weights: Tensor, length: int) -> Tensor:
    """(n, S) first source pixels and (n, S, K) weights -> (n, S, length) resampling matrices by
    one scatter, into length + K columns so that every tap has a column of its own (those past a
    window weigh 0; the extra columns are sliced off)."""
    taps = weights.shape[-1]
    index = first[..., None] + torch.arange(taps, device=first.device)
    return weights.new_zeros(*first.shape, length + taps).scatter_(2, index, weights)[..., :length]


@contextmanager
def exact_float32(device: torch.device) -> Iterator[None]:
    """float32 matmuls without TF32 on CUDA: pixel values up to 255 times weights rounded to
    TF32's 10-bit mantissa move the result by tenths of a grey level, and flip its rounding."""
    matmul = torch.backends.cuda.matmul
    if device.type != "cuda":
        yield
        return
    # torch >= 2.9 refuses to read the legacy allow_tf32 once fp32_precision was set; not this
    name, exact = (
        ("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    )
    before = getattr(matmul, name)
    setattr(matmul, name, exact)
    try:
        yield
    finally:
        setattr(matmul, name, before)


def packed_copy(arrays: list[np.ndarray], dtype, device: torch.device) -> list[Tensor]:
    """Host arrays -> views of one copy on ``device``, made without waiting for the device's
    queued work (pinned on CUDA: a pageable copy synchronises with the training step in flight)."""
    flat = np.concatenate([np.ascontiguousarray(a, dtype=dtype).ravel() for a in arrays])
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        packed = host.pin_memory().to(device, non_blocking=True)
    else:
        packed = host.to(device)
    views, offset = [], 0
    for a in arrays:
        views.append(packed[offset : offset + a.size].view(a.shape))
        offset += a.size
    return views
