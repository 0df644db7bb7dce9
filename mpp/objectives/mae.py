"""MAE, the asymmetric masked autoencoder (He et al., 2111.06377; docs/ARCHITECTURE.md §4.3).

Mask 75 % of the patches at random (exact count), run the encoder on the visible 25 % and
the cls token only, then a light decoder on the full sequence (visible tokens + one shared
mask token + fixed sin-cos positions) predicts the pixels of every patch. The loss is the
MSE against per-patch normalised pixels, on the masked patches only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from mpp.masking import MaskGenerator, mask_indices
from mpp.models.decoder import Decoder, DecoderEmbed
from mpp.models.vit import VisionTransformer
from mpp.objectives.base import PerPatch, PerPatchObjective, Pixels, Section, register
from mpp.ops import gather_tokens, patchify


class DecoderSize(BaseModel):
    """A decoder's size: MAE's pixel decoder, HPM's loss predictor (and its MAE base's decoder)."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    decoder_dim: int = Field(512, gt=0)
    """The decoder's width (MAE: 512)."""
    decoder_depth: int = Field(8, gt=0)
    """The decoder's blocks (MAE: 8)."""
    decoder_heads: int = Field(16, gt=0)
    """The decoder's attention heads (MAE: 16)."""
    mlp_ratio: float = Field(4.0, gt=0)
    """The decoder blocks' MLP width over their token width."""
    attn_backend: Literal["auto", "xformers", "sdpa", "math"] = "auto"
    """The decoder's attention backend (as model.attn_backend)."""

    @model_validator(mode="after")
    def _heads_divide_the_width(self) -> DecoderSize:
        if self.decoder_dim % 4 or self.decoder_dim % self.decoder_heads:
            raise ValueError(
                f"decoder_dim {self.decoder_dim} must be divisible by 4 (sin-cos positions) and "
                f"by decoder_heads {self.decoder_heads}"
            )
        return self


class MAEBase(Section):
    """MAE beside its decoder's size: what HPM nests as its base (the size is HPM's)."""

    name: Literal["mae"] = "mae"
    """The objective: mae."""
    mask_ratio: float = Field(0.75, gt=0.0, lt=1.0)
    """MAE needs visible and masked patches."""
    norm_pix_loss: bool = True
    """Standardise each target patch by its own mean and variance (MAE's recommended setting; HPM's
    released scripts train without)."""


class MAEConfig(MAEBase, DecoderSize):
    """MAE (mpp.objectives.mae)."""


def normalize_patches(patches: Tensor, eps: float = 1e-6) -> Tensor:
    """MAE's norm_pix target: (y - mean) / sqrt(var + eps) per patch over its P*P*C values.

    var is the unbiased estimate, as in MAE's ``target.var(dim=-1)``."""
    mean = patches.mean(dim=-1, keepdim=True)
    var = patches.var(dim=-1, keepdim=True)
    return (patches - mean) / (var + eps) ** 0.5


@register(MAEConfig, as_base=MAEBase)
class MaskedAutoencoder(PerPatchObjective):
    """Targets are computed on the normalised images the objective receives, as MAE does."""

    def __init__(
        self,
        encoder: VisionTransformer,
        mask_generator: MaskGenerator | None,
        cfg: MAEConfig,
        pixels: Pixels | None = None,
    ) -> None:
        """MAE of section ``cfg`` around ``encoder`` (``pixels`` unused: its targets are the
        normalised images)."""
        super().__init__()
        mask_ratio, decoder_dim = cfg.mask_ratio, cfg.decoder_dim
        self.encoder = encoder
        self.use_masks(encoder, mask_generator, mask_ratio)
        self.norm_pix_loss = cfg.norm_pix_loss
        self.token_dim = decoder_dim  # what HPM's loss predictor reads: the decoder input
        patch_dim = encoder.patch_size**2 * encoder.patch_embed.in_chans
        self.decoder_embed = DecoderEmbed(
            encoder.embed_dim, decoder_dim, encoder.grid_size, encoder.num_prefix_tokens
        )
        self.decoder = Decoder(
            decoder_dim,
            cfg.decoder_depth,
            cfg.decoder_heads,
            patch_dim,
            mlp_ratio=cfg.mlp_ratio,
            attn_backend=cfg.attn_backend,
        )

    def no_weight_decay(self) -> set[str]:
        return {"decoder_embed.mask_token"} | {
            f"encoder.{n}" for n in self.encoder.no_weight_decay()
        }

    # ---- the algorithm, one step a method -------------------------------------------------

    def forward_encoder(self, images: Tensor, visible_idx: Tensor | None) -> Tensor:
        """Images -> normed tokens (B, 1 + N_vis, D): the blocks see the visible patches only."""
        return self.encoder.encode(self.encoder.patch_embed(images), visible_idx)

    def forward_decoder(self, tokens: Tensor) -> Tensor:
        """Decoder input (B, 1 + N, Dd) -> pixel predictions (B, N, P*P*C)."""
        return self.decoder(tokens)[:, self.encoder.num_prefix_tokens :]

    def targets(self, images: Tensor) -> Tensor:
        """Per-patch pixel targets (B, N, P*P*C), standardised per patch under norm_pix_loss."""
        target = patchify(images, self.encoder.patch_size).float()
        return normalize_patches(target) if self.norm_pix_loss else target

    def forward_loss(self, images: Tensor, pred: Tensor, masked_idx: Tensor) -> Tensor:
        """Per-patch MSE (B, N_mask) on the masked patches only."""
        target = gather_tokens(self.targets(images), masked_idx)
        return (gather_tokens(pred, masked_idx).float() - target).pow(2).mean(dim=-1)

    def predictor_tokens(self, images: Tensor, mask: Tensor | None = None) -> Tensor:
        """Decoder input (B, 1 + N, Dd) of the fully visible image, or under ``mask`` (the
        visible tokens and the mask token): what HPM's teacher scores."""
        visible_idx = None if mask is None else mask_indices(mask, self.num_masked)[0]
        return self.decoder_embed(self.forward_encoder(images, visible_idx), visible_idx)

    def forward_per_patch(self, images: Tensor, mask: Tensor | None = None) -> PerPatch:
        """The step up to per-patch losses (``PerPatch``): n = N_mask, pred (B, N, P*P*C)."""
        if mask is None:
            mask = self.mask_generator(images.shape[0], images.device)
        visible_idx, masked_idx = mask_indices(mask, self.num_masked)  # (B, N_vis), (B, N_mask)
        latent = self.forward_encoder(images, visible_idx)  # (B, 1 + N_vis, D)
        tokens = self.decoder_embed(latent, visible_idx)  # (B, 1 + N, Dd)
        pred = self.forward_decoder(tokens)
        loss = self.forward_loss(images, pred, masked_idx)
        return {"loss": loss, "idx": masked_idx, "mask": mask, "tokens": tokens, "pred": pred}

    def per_image_metrics(self, out: PerPatch) -> dict[str, Tensor]:
        return {"rec_loss": out["loss"].mean(1)}
