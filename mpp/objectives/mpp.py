"""BERT-style masked patch prediction, the ViT paper's self-supervision (2010.11929 §4.6, App. B.1.2).

Corrupt 50 % of the patch *embeddings*: of the corrupted, 80 % become one learnable [mask]
embedding, 10 % the embedding of another patch of the same image, 10 % stay as they are.
From each corrupted token's output predict its patch's 3-bit mean colour (512 classes);
the loss is cross-entropy over the corrupted positions only.

Other channel counts (grey, multispectral bands; docs/ARCHITECTURE.md): the colour is factorised,
one ``bits``-bit class of each channel's mean (C heads of 2^bits classes, the loss their mean);
RGB keeps the paper's joint 512-class target exactly.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from pydantic import Field, model_validator
from torch import Tensor, nn

from mpp.masking import MaskGenerator, mask_indices
from mpp.models.vit import VisionTransformer
from mpp.objectives.base import PerPatch, PerPatchObjective, Pixels, Section, register
from mpp.ops import IMAGENET_MEAN, IMAGENET_STD, gather_tokens, patchify, unnormalize

MPP_TARGETS = ("mean_color", "downsampled", "pixel")


class MPPConfig(Section):
    """The ViT paper's masked patch prediction (mpp.objectives.mpp)."""

    name: Literal["mpp"] = "mpp"
    """The objective: mpp."""
    mask_ratio: float = Field(0.5, ge=0.0, le=1.0)
    """The share of patch embeddings corrupted (the ViT paper: 50 %)."""
    mask_token_prob: float = Field(0.8, ge=0.0, le=1.0)
    """Of the corrupted: the share replaced by the learned [mask] embedding (80 %)."""
    random_token_prob: float = Field(0.1, ge=0.0, le=1.0)
    """Of the corrupted: the share replaced by another patch of the same image (10 %)."""
    keep_prob: float = Field(0.1, ge=0.0, le=1.0)
    """Of the corrupted: the share kept as it is (10 %); the three sum to 1."""
    target: Literal[MPP_TARGETS] = "mean_color"
    """mean_color: each corrupted patch's mean colour class (the paper's); downsampled: a class per
    cell of the patch; pixel: L2 regression of its pixels."""
    bits: int = Field(3, ge=1, le=8)
    """Bits per channel of the colour classes (3: 512 RGB classes)."""
    downsample_cells: int = Field(4, ge=1)
    """The downsampled target's cells per side."""

    @model_validator(mode="after")
    def _corruptions_sum_to_one(self) -> MPPConfig:
        probs = (self.mask_token_prob, self.random_token_prob, self.keep_prob)
        if abs(sum(probs) - 1.0) > 1e-6:
            raise ValueError(
                f"mask_token_prob + random_token_prob + keep_prob must sum to 1, got {probs}"
            )
        return self


def color_classes(rgb_means: Tensor, bits: int = 3) -> Tensor:
    """(..., 3) channel means in [0, 1] -> class ids r*L^2 + g*L + b with L = 2**bits levels."""
    levels = 2**bits
    q = (rgb_means * levels).floor().clamp_(0, levels - 1).long()  # min(floor(mean * L), L - 1)
    return (q[..., 0] * levels + q[..., 1]) * levels + q[..., 2]


def channel_classes(means: Tensor, bits: int = 3) -> Tensor:
    """(..., C) channel means in [0, 1] -> one class per channel (..., C) in [0, 2**bits)."""
    levels = 2**bits
    return (means * levels).floor().clamp_(0, levels - 1).long()


def mean_color_targets(raw: Tensor, patch_size: int, bits: int = 3, cells: int = 1) -> Tensor:
    """Raw images (B, C, H, W) in [0, 1] -> colour classes: RGB's joint class (B, N) for
    cells=1, or (B, N, cells^2) for the 'downsampled' target (each patch cut into cells x cells,
    one class per cell); another channel count one class per channel, (B, N, cells^2 * C)."""
    if patch_size % cells:
        raise ValueError(f"patch_size {patch_size} is not divisible by downsample cells {cells}")
    means = F.avg_pool2d(raw, kernel_size=patch_size // cells)  # (B, C, gh*cells, gw*cells)
    means = rearrange(means, "b c (h i) (w j) -> b (h w) (i j) c", i=cells, j=cells)
    if raw.shape[1] != 3:  # factorised: (B, N, cells^2, C) -> (B, N, cells^2 * C)
        return channel_classes(means, bits).flatten(2)
    classes = color_classes(means, bits)  # (B, N, cells^2)
    return classes[..., 0] if cells == 1 else classes


class MPPPerPatch(PerPatch):
    correct: Tensor  # (B, n): whether each prediction was right
    kind: Tensor  # (B, N): what each patch became (mask token, random patch, kept)


@register(MPPConfig)
class MaskedPatchPrediction(PerPatchObjective):
    def __init__(
        self,
        encoder: VisionTransformer,
        mask_generator: MaskGenerator | None,
        cfg: MPPConfig,
        pixels: Pixels = (IMAGENET_MEAN, IMAGENET_STD),
    ) -> None:
        """MPP of section ``cfg`` around ``encoder``; ``pixels``: the data's (mean, std)."""
        super().__init__()
        mean, std = pixels
        target, bits, downsample_cells = cfg.target, cfg.bits, cfg.downsample_cells
        self.encoder = encoder
        self.use_masks(encoder, mask_generator, cfg.mask_ratio, some_visible=False)
        self.num_corrupt = self.num_masked
        self.mask_token_prob, self.random_token_prob = cfg.mask_token_prob, cfg.random_token_prob
        self.target, self.bits, self.cells = target, bits, downsample_cells
        self.mean, self.std = tuple(mean), tuple(std)

        dim, patch = encoder.embed_dim, encoder.patch_size
        self.token_dim = dim  # what HPM's loss predictor reads: the encoder's output tokens
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))  # [mask], in embedding space
        nn.init.normal_(self.mask_token, std=0.02)
        chans = encoder.patch_embed.in_chans
        # RGB: one joint class of 2^(3 bits); C channels: C classes of 2^bits (factorised)
        self.num_classes = 2 ** (3 * bits) if chans == 3 else 2**bits
        groups = 1 if chans == 3 else chans  # classes predicted per patch (or cell)
        out = {
            "mean_color": groups * self.num_classes,
            "downsampled": downsample_cells**2 * groups * self.num_classes,
            "pixel": patch * patch * chans,
        }[target]
        if target == "downsampled" and patch % downsample_cells:
            raise ValueError(
                f"patch_size {patch} is not divisible by downsample_cells {downsample_cells}"
            )
        self.head = nn.Linear(dim, out)
        nn.init.xavier_uniform_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def no_weight_decay(self) -> set[str]:
        return {"mask_token"} | {f"encoder.{n}" for n in self.encoder.no_weight_decay()}

    def set_pixel_stats(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.mean, self.std = tuple(mean), tuple(std)

    # ---- the algorithm, one step a method -------------------------------------------------

    def corrupt(self, tokens: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Patch embeddings (B, N, D) -> corrupted embeddings, and the kind of each token
        (B, N) int8: 0 clean, 1 [mask], 2 another patch of the same image, 3 kept."""
        B, N, _ = tokens.shape
        u = torch.rand(B, N, device=tokens.device)
        swapped_or_kept = torch.where(u < self.mask_token_prob + self.random_token_prob, 2, 3)
        kind = torch.where(u < self.mask_token_prob, 1, swapped_or_kept)
        kind = torch.where(mask, kind, 0).to(torch.int8)
        # a uniformly drawn *other* patch: offset by 1..N-1 so it can never be the token itself
        other = (
            torch.arange(N, device=tokens.device)
            + torch.randint(1, max(N, 2), (B, N), device=tokens.device)
        ) % N
        swapped = gather_tokens(tokens, other)
        out = torch.where((kind == 1).unsqueeze(-1), self.mask_token.to(tokens.dtype), tokens)
        out = torch.where((kind == 2).unsqueeze(-1), swapped, out)
        return out, kind

    def targets(self, images: Tensor) -> Tensor:
        """Per-patch targets on un-normalised pixels: RGB (B, N) classes or (B, N, 16) for
        'downsampled', (B, N, groups) classes for other channel counts, or (B, N, P*P*C)."""
        raw = unnormalize(images, self.mean, self.std)
        if self.target == "pixel":
            return patchify(raw, self.encoder.patch_size)
        cells = 1 if self.target == "mean_color" else self.cells
        return mean_color_targets(raw, self.encoder.patch_size, self.bits, cells)

    def forward_loss(self, pred: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        """Per-patch loss (B, n) and per-patch accuracy (B, n) (zeros for the regression target)."""
        if self.target == "pixel":
            loss = (pred.float() - target).pow(2).mean(dim=-1)
            return loss, torch.zeros_like(loss)
        # (B, n, groups, classes): groups = cells^2 (RGB) or cells^2 * C (factorised), or 1
        logits = pred.float().reshape(*target.shape[:2], -1, self.num_classes)
        target = target.reshape(*target.shape[:2], -1)
        ce = F.cross_entropy(logits.flatten(0, 2), target.flatten(), reduction="none").view_as(
            target
        )
        correct = (logits.argmax(-1) == target).float()
        return ce.mean(-1), correct.mean(-1)

    def predictor_tokens(self, images: Tensor, mask: Tensor | None = None) -> Tensor:
        """Encoder tokens (B, 1 + N, D) of the clean image, or with ``mask``'s patches corrupted
        (80/10/10, as in training): what HPM's teacher scores."""
        if mask is None:
            return self.encoder.forward_features(images)
        return self.encoder.encode(self.corrupt(self.encoder.patch_embed(images), mask)[0])

    def forward_per_patch(self, images: Tensor, mask: Tensor | None = None) -> MPPPerPatch:
        """The step up to per-patch losses (``MPPPerPatch``), n the corrupted patches."""
        B = images.shape[0]
        if mask is None:
            mask = self.mask_generator(B, images.device)  # (B, N), exactly num_corrupt True
        _, corrupt_idx = mask_indices(mask, self.num_corrupt)  # (B, n)
        tokens, kind = self.corrupt(self.encoder.patch_embed(images), mask)
        latent = self.encoder.encode(tokens)  # (B, 1 + N, D)
        # (B, n, out)
        pred = self.head(gather_tokens(latent[:, self.encoder.num_prefix_tokens :], corrupt_idx))
        target = gather_tokens(self.targets(images), corrupt_idx)
        loss, correct = self.forward_loss(pred, target)
        return {
            "loss": loss,
            "correct": correct,
            "idx": corrupt_idx,
            "kind": kind,
            "mask": mask,
            "tokens": latent,
            "pred": pred,
        }

    def per_image_metrics(self, out: MPPPerPatch) -> dict[str, Tensor]:
        """Masked-patch accuracy (the ViT paper's pretraining metric) and cross-entropy per image."""
        metrics = {"masked_loss": out["loss"].mean(1)}
        if self.target != "pixel":
            metrics["masked_acc"] = out["correct"].mean(1)
        return metrics

    def forward(self, images: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        out = self.forward_per_patch(images)
        loss = out["loss"].mean()
        kind = out["kind"]
        n = float(self.num_corrupt * images.shape[0])
        metrics = {
            "loss": loss.detach(),
            "corrupt_frac": (kind > 0).float().mean(),
            "frac_mask_token": (kind == 1).sum() / n,
            "frac_random_token": (kind == 2).sum() / n,
            "frac_kept": (kind == 3).sum() / n,
        }
        if self.target != "pixel":
            metrics["acc"] = out["correct"].mean().detach()
        return loss, metrics
