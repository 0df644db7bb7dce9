"""What a pretraining objective sees, as pictures (PIL only), one row per image, drawn by
``python -m mpp.tools.viz`` and the previews (``mpp.train.preview``; docs/ARCHITECTURE.md §3.6).

HPM: input | mask (grey: random, red: hard by the teacher) | reconstruction (visible patches from
the input) | teacher's predicted loss. MAE / MPP: input | mask | reconstruction (MPP: each masked
patch in its predicted colour; MAE with ``norm_pix_loss``: un-normalised with each true patch's
own mean and variance). Other channel counts: three of them (``data.display_channels``), or grey."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from PIL import Image
from torch import Tensor

from mpp.objectives.base import Objective
from mpp.objectives.hpm import HardPatchesMining
from mpp.objectives.hpm_mask import hard_patch_mask
from mpp.ops import gather_tokens, patchify, unnormalize, unpatchify

RANDOM_COLOR = (0.5, 0.5, 0.5)
HARD_COLOR = (1.0, 0.15, 0.1)
GAP = 2  # pixels between panels


def _patch_colors(classes: Tensor, bits: int) -> Tensor:
    """Colour classes (...) -> the centres of their bins (..., 3) in [0, 1]."""
    levels = 2**bits
    rgb = torch.stack([classes // levels**2, classes // levels % levels, classes % levels], dim=-1)
    return (rgb.float() + 0.5) / levels


def display(raw: Tensor, show: Sequence[int] | None = None) -> Tensor:
    """Raw pixels (B, C, H, W) -> (B, 3, H, W) to look at: the channels ``show`` (default the
    first three), a single one as grey."""
    chosen = list(show) if show is not None else list(range(min(raw.shape[1], 3)))
    if len(chosen) < 3:
        return raw[:, chosen[:1]].expand(-1, 3, -1, -1)
    return raw[:, chosen]


def predicted_patches(
    base, images: Tensor, out: dict[str, Tensor], mean: tuple[float, ...], std: tuple[float, ...]
) -> Tensor:
    """The base's predictions for the masked patches (B, N_mask, P*P*C), as raw pixels in [0, 1]
    (MPP: the centre of each predicted colour bin, per channel where the target is factorised)."""
    P = base.encoder.patch_size
    if hasattr(base, "norm_pix_loss"):  # pixels of the normalised images: MAE's, SimMIM's
        pred = gather_tokens(out["pred"].float(), out["idx"])
        if base.norm_pix_loss:  # undo the per-patch standardisation with the true patch's stats
            true = gather_tokens(patchify(images, P).float(), out["idx"])
            mean_p, var_p = true.mean(dim=-1, keepdim=True), true.var(dim=-1, keepdim=True)
            pred = pred * (var_p + 1e-6) ** 0.5 + mean_p
        pred = rearrange(pred, "b n (pq c) -> b n pq c", c=images.shape[1])
        return (pred * images.new_tensor(std) + images.new_tensor(mean)).clamp(0, 1).flatten(2)
    if base.target == "pixel":
        return out["pred"].float().clamp(0, 1)
    cells, C = (1 if base.target == "mean_color" else base.cells), images.shape[1]
    if C == 3:  # the joint colour class
        logits = out["pred"].float().reshape(*out["idx"].shape, cells, cells, base.num_classes)
        colors = _patch_colors(logits.argmax(-1), base.bits)  # (B, n, cells, cells, 3)
    else:  # a class per channel
        shape = (*out["idx"].shape, cells, cells, C, base.num_classes)
        colors = (out["pred"].float().reshape(shape).argmax(-1) + 0.5) / 2**base.bits
    pixels = repeat(colors, "b n i j c -> b n (i p) (j q) c", p=P // cells, q=P // cells)
    return pixels.flatten(2)


def heat_colors(values: Tensor) -> Tensor:
    """Per-row min-max scaled scores (B, N) -> black-red-yellow colours (B, N, 3)."""
    lo, hi = values.min(dim=1, keepdim=True).values, values.max(dim=1, keepdim=True).values
    v = (values - lo) / (hi - lo).clamp(min=1e-12)
    return torch.stack([(2 * v).clamp(0, 1), (2 * v - 1).clamp(0, 1), 0.15 * (1 - v)], dim=-1)


def masked_panels(
    base,
    images: Tensor,
    masks: tuple[Tensor, Tensor],
    pixels: tuple[tuple[float, ...], tuple[float, ...]],
    show: Sequence[int] | None = None,
) -> list[Tensor]:
    """input | mask (grey, the ``hard`` ones red) | reconstruction, each (B, 3, H, W) in [0, 1],
    of an MAE or MPP objective run on ``masks`` = (mask, hard), each (B, N); ``pixels`` the
    data's (mean, std); ``show`` the channels shown (``display``)."""
    (mask, hard), (mean, std) = masks, pixels
    P, grid = base.encoder.patch_size, base.encoder.grid_size
    out = base.forward_per_patch(images, mask)
    raw = unnormalize(images.float(), mean, std)  # (B, C, H, W) in [0, 1]
    raw_patches = patchify(raw, P)  # (B, N, P*P*C)
    predicted = predicted_patches(base, images, out, mean, std)  # (B, N_mask, P*P*C)
    idx = out["idx"].unsqueeze(-1).expand(-1, -1, raw_patches.shape[-1])
    recon = raw_patches.scatter(1, idx, predicted)  # visible patches as they are, masked predicted
    seen = display(raw, show)
    seen_patches = patchify(seen, P)  # (B, N, P*P*3)

    def tint(color: tuple[float, ...]) -> Tensor:  # the patches, 75 % covered by a colour
        return 0.25 * seen_patches + 0.75 * seen_patches.new_tensor(color).repeat(P * P)

    shown = torch.where(mask.unsqueeze(-1), tint(RANDOM_COLOR), seen_patches)
    shown = torch.where(hard.unsqueeze(-1), tint(HARD_COLOR), shown)
    return [seen, unpatchify(shown, grid, P), display(unpatchify(recon, grid, P), show)]


@torch.no_grad()
def objective_panels(
    objective: Objective,
    images: Tensor,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    num_hard: int | None = None,
    show: Sequence[int] | None = None,
) -> list[Tensor]:
    """HPM's four panels, or MAE's / MPP's three on a mask from their own generator, each
    (B, 3, H, W) in [0, 1]; in eval mode. ``num_hard`` overrides HPM's k; ``show``: which
    channels the pictures show (``display``)."""
    was_training = objective.training
    objective.eval()
    try:
        if not isinstance(objective, HardPatchesMining):
            mask = objective.mask_generator(images.shape[0], images.device)  # (B, N)
            masks = (mask, torch.zeros_like(mask))
            return masked_panels(objective, images, masks, (mean, std), show)
        k = objective.num_hard if num_hard is None else num_hard
        P, grid = objective.encoder.patch_size, objective.encoder.grid_size
        scores = objective.teacher_scores(images)  # (B, N)
        masks = hard_patch_mask(scores, objective.num_masked, k)
        pixels = (objective.mean, objective.std)
        panels = masked_panels(objective.base, images, masks, pixels, show)
        heat = heat_colors(scores).repeat(1, 1, P * P)  # (B, N, P*P*3)
        return panels + [unpatchify(heat, grid, P)]
    finally:
        objective.train(was_training)


def picture_size(
    num_images: int, height: int, width: int, scale: int, panels: int = 4
) -> tuple[int, int]:
    """(width, height) in pixels of the grid ``save_picture`` writes."""
    grid_width = panels * width * scale + (panels + 1) * GAP
    grid_height = num_images * height * scale + (num_images + 1) * GAP
    return grid_width, grid_height


def panel_grid(panels: list[Tensor], scale: int | None = None) -> Tensor:
    """Panels (each (B, 3, H, W) in [0, 1]) side by side, one row per image, on white: (3, H', W')
    uint8. ``scale`` enlarges each panel (default: to at least 96 px)."""
    B, _, H, W = panels[0].shape
    scale = scale or max(1, math.ceil(96 / max(H, W)))
    width, height = picture_size(B, H, W, scale, len(panels))
    canvas = torch.full((3, height, width), 255, dtype=torch.uint8)
    for col, panel in enumerate(panels):
        panel = F.interpolate(panel.float().cpu(), scale_factor=scale, mode="nearest")
        tiles = (panel.clamp(0, 1) * 255).round().byte()  # (B, 3, H*s, W*s)
        x = GAP + col * (W * scale + GAP)
        for row in range(B):
            y = GAP + row * (H * scale + GAP)
            canvas[:, y : y + H * scale, x : x + W * scale] = tiles[row]
    return canvas


def save_picture(panels: list[Tensor], path: str | Path, scale: int | None = None) -> Image.Image:
    picture = Image.fromarray(panel_grid(panels, scale).permute(1, 2, 0).numpy())
    picture.save(path, format="PNG")
    return picture
