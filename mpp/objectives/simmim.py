"""SimMIM, simple masked image modelling (Xie et al., 2111.09886; docs/ARCHITECTURE.md
§4.10).

Replace the masked patch embeddings by one learnable mask token (masks from ``masking``: the
paper's are random 32-px mask units, ``units``), run the encoder on all tokens, and predict the
raw pixels of every patch with one linear layer; the loss is L1 against the (normalised) input
pixels, on the masked patches only: sum |pred - x| over them / (num_masked * P*P*C).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from mpp.masking import MaskGenerator, mask_indices
from mpp.models.vit import VisionTransformer
from mpp.objectives.base import PerPatch, PerPatchObjective, Pixels, Section, register
from mpp.ops import gather_tokens, patchify


class SimMIMConfig(Section):
    """SimMIM (mpp.objectives.simmim)."""

    name: Literal["simmim"] = "simmim"
    """The objective: simmim."""
    mask_ratio: float = Field(0.6, gt=0.0, lt=1.0)
    """The share of patches replaced by the mask token (the paper: 0.6, on 32-px mask units:
    masking.strategy="units")."""


@register(SimMIMConfig)
class SimMIM(PerPatchObjective):
    """Targets are the normalised images the objective receives, as SimMIM's (no norm_pix)."""

    def __init__(
        self,
        encoder: VisionTransformer,
        mask_generator: MaskGenerator | None,
        cfg: SimMIMConfig,
        pixels: Pixels | None = None,
    ) -> None:
        """SimMIM of section ``cfg`` around ``encoder`` (``pixels`` unused)."""
        super().__init__()
        self.encoder = encoder
        self.use_masks(encoder, mask_generator, cfg.mask_ratio)
        self.norm_pix_loss = False  # the target: the normalised input itself (the pictures read it)
        dim = encoder.embed_dim
        self.token_dim = dim  # what HPM's loss predictor reads: the encoder's output tokens
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        self.head = nn.Linear(dim, encoder.patch_size**2 * encoder.patch_embed.in_chans)

    def no_weight_decay(self) -> set[str]:
        return {"mask_token"} | {f"encoder.{n}" for n in self.encoder.no_weight_decay()}

    # ---- the algorithm, one step a method -------------------------------------------------

    def predictor_tokens(self, images: Tensor, mask: Tensor | None = None) -> Tensor:
        """Encoder tokens (B, 1 + N, D) of the image, with ``mask``'s patch embeddings replaced
        by the mask token (all visible when None): what the head and HPM's teacher read."""
        tokens = self.encoder.patch_embed(images)  # (B, N, D)
        if mask is not None:
            tokens = torch.where(mask.unsqueeze(-1), self.mask_token.to(tokens.dtype), tokens)
        return self.encoder.encode(tokens)

    def forward_loss(self, images: Tensor, pred: Tensor, masked_idx: Tensor) -> Tensor:
        """Per-patch L1 (B, N_mask) on the masked patches, each the mean over its P*P*C values."""
        target = gather_tokens(patchify(images, self.encoder.patch_size).float(), masked_idx)
        return (gather_tokens(pred, masked_idx).float() - target).abs().mean(dim=-1)

    def forward_per_patch(self, images: Tensor, mask: Tensor | None = None) -> PerPatch:
        """The step up to per-patch losses (``PerPatch``): n = N_mask, pred (B, N, P*P*C)."""
        if mask is None:
            mask = self.mask_generator(images.shape[0], images.device)
        _, masked_idx = mask_indices(mask, self.num_masked)  # (B, N_mask)
        tokens = self.predictor_tokens(images, mask)  # (B, 1 + N, D)
        pred = self.head(tokens[:, self.encoder.num_prefix_tokens :])  # (B, N, P*P*C)
        loss = self.forward_loss(images, pred, masked_idx)
        return {"loss": loss, "idx": masked_idx, "mask": mask, "tokens": tokens, "pred": pred}

    def per_image_metrics(self, out: PerPatch) -> dict[str, Tensor]:
        return {"rec_l1": out["loss"].mean(1)}
