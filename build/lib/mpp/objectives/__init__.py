"""Pretraining objectives: each an nn.Module with ``forward(images) -> (loss, metrics)``."""

from typing import Any

from mpp.masking import MaskGenerator
from mpp.models.vit import VisionTransformer
from mpp.objectives.base import Objective
from mpp.objectives.configs import parse_objective
from mpp.objectives.hpm import HPM_BASES, PRED_LOSSES, HardPatchesMining
from mpp.objectives.mae import MaskedAutoencoder
from mpp.objectives.mpp import MPP_TARGETS, MaskedPatchPrediction
from mpp.ops import IMAGENET_MEAN, IMAGENET_STD

OBJECTIVES: dict[str, type[Objective]] = {
    "mpp": MaskedPatchPrediction,
    "mae": MaskedAutoencoder,
    "hpm": HardPatchesMining,
}


def create_objective(
    name: str,
    encoder: VisionTransformer,
    mask_generator: MaskGenerator | None = None,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
    **kwargs: Any,
) -> Objective:
    """The objective registered as ``name`` around ``encoder`` (timm's ``create_model`` for
    objectives), its arguments flat and checked by its typed section (``mpp.objectives.configs``,
    the same as a config's ``objective``); ``mean``/``std`` are the data's. Unknown names or
    arguments raise ValueError naming them. A config builds through ``mpp.build.build_objective``."""
    return parse_objective(name, kwargs).build(encoder, mask_generator, (mean, std))


__all__ = [
    "HPM_BASES",
    "MPP_TARGETS",
    "OBJECTIVES",
    "PRED_LOSSES",
    "HardPatchesMining",
    "MaskedAutoencoder",
    "MaskedPatchPrediction",
    "Objective",
    "create_objective",
]
