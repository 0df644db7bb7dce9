"""The ``objective`` section of a pretraining config, typed: one model per objective keyed on
``name`` (``ObjectiveConfig``), each with its defaults and ``build``. pydantic names a bad or
unknown key (``objective.decoder_dim``) with the file, before anything is created.

HPM's is ``HPMConfig`` with its base nested (``base: {"name": "mae", ...}``); the flat form of
the shipped configs (``"base": "mae"`` with the base's keys beside HPM's) is read too and nested.
The decoder's size (``decoder_*``, ``mlp_ratio``, ``attn_backend``) is HPM's: its loss predictor
and, for MAE, the base's pixel decoder share it, so the nested base does not repeat it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mpp.masking import MaskGenerator
from mpp.models.vit import VisionTransformer
from mpp.objectives.hpm import PRED_LOSSES, TEACHER_VIEWS, HardPatchesMining
from mpp.objectives.hpm_mask import SCHEDULES
from mpp.objectives.mae import MaskedAutoencoder
from mpp.objectives.mpp import MPP_TARGETS, MaskedPatchPrediction
from mpp.sections import refusal

Pixels = tuple[tuple[float, ...], tuple[float, ...]]  # the data's (mean, std)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    def kwargs(self) -> dict[str, Any]:
        """The constructor's arguments this section sets (all but ``name``)."""
        return self.model_dump(exclude={"name"})


class _Decoder(BaseModel):
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
    def _heads_divide_the_width(self) -> _Decoder:
        if self.decoder_dim % 4 or self.decoder_dim % self.decoder_heads:
            raise ValueError(
                f"decoder_dim {self.decoder_dim} must be divisible by 4 (sin-cos positions) and "
                f"by decoder_heads {self.decoder_heads}"
            )
        return self


class MPPConfig(_Section):
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

    def build(
        self, encoder: VisionTransformer, mask: MaskGenerator | None, pixels: Pixels
    ) -> MaskedPatchPrediction:
        return MaskedPatchPrediction(encoder, mask, mean=pixels[0], std=pixels[1], **self.kwargs())

    def build_base(
        self, encoder: VisionTransformer, decoder: _Decoder, pixels: Pixels
    ) -> MaskedPatchPrediction:
        """HPM's base (its masks are HPM's): MPP's head is linear, so no decoder of its own."""
        return self.build(encoder, None, pixels)


class MAEBase(_Section):
    """MAE beside its decoder's size: what HPM nests as its base."""

    name: Literal["mae"] = "mae"
    """The objective: mae."""
    mask_ratio: float = Field(0.75, gt=0.0, lt=1.0)
    """MAE needs visible and masked patches."""
    norm_pix_loss: bool = True
    """Standardise each target patch by its own mean and variance (MAE's recommended setting; HPM's
    released scripts train without)."""

    def build_base(
        self, encoder: VisionTransformer, decoder: _Decoder, pixels: Pixels
    ) -> MaskedAutoencoder:
        """HPM's base (its masks are HPM's), its pixel decoder the size of HPM's ``decoder``."""
        return MaskedAutoencoder(
            encoder, None, **self.kwargs(), **decoder.model_dump(include=set(_Decoder.model_fields))
        )


class MAEConfig(MAEBase, _Decoder):
    """MAE (mpp.objectives.mae)."""

    def build(
        self, encoder: VisionTransformer, mask: MaskGenerator | None, pixels: Pixels
    ) -> MaskedAutoencoder:
        return MaskedAutoencoder(encoder, mask, **self.kwargs())


class HPMConfig(_Section, _Decoder):
    """HPM (mpp.objectives.hpm) around ``base``; it chooses its masks itself (its teacher)."""

    name: Literal["hpm"] = "hpm"
    """The objective: hpm."""
    base: Annotated[MAEBase | MPPConfig, Field(discriminator="name")] = MAEBase()
    """The objective HPM wraps, with its keys: mae (the paper's) or mpp."""
    hard_ratio: float = Field(0.5, ge=0.0, le=1.0)
    """alpha_T: the share of the mask chosen as the teacher's hardest patches at the end of training
    (0.5)."""
    schedule: Literal[SCHEDULES] = "easy_to_hard"
    """How that share grows: easy_to_hard (the paper's, alpha_T (e+1)/T per epoch), hard_only,
    hard_to_easy, random."""
    pred_loss: Literal[PRED_LOSSES] = "ranking"
    """The loss predictor's objective: ranking (the paper's pairwise BCE) or mse (against the per-
    image z-scored loss)."""
    pred_weight: float = Field(1.0, ge=0.0)
    """The loss predictor's weight in the total loss."""
    momentum_start: float = Field(0.999, ge=0.0, le=1.0)
    """The teacher's EMA momentum at the start."""
    momentum_end: float = Field(0.9999, ge=0.0, le=1.0)
    """The teacher's EMA momentum after momentum_epochs (set once per epoch)."""
    momentum_epochs: float = 100.0
    """Epochs over which the momentum rises linearly."""
    teacher_view: Literal[TEACHER_VIEWS] = "visible"
    """What the teacher scores to choose the hard patches: the fully visible image (the paper's)
    or views that mask each patch as training does (masked; RESULTS.md compares them)."""

    @model_validator(mode="before")
    @classmethod
    def _nest_the_base(cls, raw: Any) -> Any:
        """The flat form (``"base": "mae"`` and the base's keys beside HPM's): nested."""
        if not isinstance(raw, dict):
            return raw
        own = set(cls.model_fields)
        base = raw.get("base", "mae")
        base = dict(base) if isinstance(base, dict) else {"name": base}
        base.update({k: v for k, v in raw.items() if k not in own})
        return {**{k: v for k, v in raw.items() if k in own}, "base": base}

    def build(
        self, encoder: VisionTransformer, mask: MaskGenerator | None, pixels: Pixels
    ) -> HardPatchesMining:
        """HPM around its base built on ``encoder``; ``mask`` must be None (the teacher masks)."""
        if mask is not None:
            raise ValueError("hpm chooses its own masks (its teacher): pass no mask generator")
        base = self.base.build_base(encoder, self, pixels)
        own = self.model_dump(exclude={"name", "base"})
        return HardPatchesMining(base, mean=pixels[0], std=pixels[1], **own)


ObjectiveConfig = Annotated[MPPConfig | MAEConfig | HPMConfig, Field(discriminator="name")]
OBJECTIVE_CONFIGS: dict[str, type[MPPConfig | MAEConfig | HPMConfig]] = {
    "mpp": MPPConfig,
    "mae": MAEConfig,
    "hpm": HPMConfig,
}


def parse_objective(name: str, kwargs: dict[str, Any]) -> MPPConfig | MAEConfig | HPMConfig:
    """``name``'s typed section from a library call's flat arguments (``create_objective``);
    a bad argument raises ValueError naming it, as a config's key is named."""
    if name not in OBJECTIVE_CONFIGS:
        raise ValueError(f"unknown objective {name!r}; allowed: {sorted(OBJECTIVE_CONFIGS)}")
    section = OBJECTIVE_CONFIGS[name]
    try:
        return section.model_validate({**kwargs, "name": name})
    except ValidationError as err:
        key, msg = refusal(err, section, kwargs)
        raise ValueError(f"objective {name!r}: " + (f"{key}: {msg}" if key else msg)) from None
