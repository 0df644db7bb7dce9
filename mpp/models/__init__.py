"""Models: the ViT encoder, its attention backends and the MAE-style decoder (docs/ARCHITECTURE.md
§4.1, §4.3)."""

from mpp.models.attention import ATTN_BACKENDS, Attention, attention, resolve_backend
from mpp.models.vit import (
    VIT_SIZES,
    VisionTransformer,
    create_vit,
    resample_abs_pos_embed,
    sincos_pos_embed,
    vit_config,
)

__all__ = [
    "ATTN_BACKENDS",
    "Attention",
    "VIT_SIZES",
    "VisionTransformer",
    "attention",
    "create_vit",
    "resample_abs_pos_embed",
    "resolve_backend",
    "sincos_pos_embed",
    "vit_config",
]
