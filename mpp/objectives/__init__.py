"""Pretraining objectives: each an nn.Module with ``forward(images) -> (loss, metrics)``, one file
each, registered there by name with its typed section (``mpp.objectives.base.REGISTRY``)."""

from typing import Any

from mpp.masking import MaskGenerator
from mpp.models.vit import VisionTransformer
from mpp.objectives.base import REGISTRY, Objective, PerPatchObjective, register
from mpp.objectives.configs import OBJECTIVE_CONFIGS, ObjectiveConfig, parse_objective
from mpp.objectives.hpm import PRED_LOSSES, HardPatchesMining, hpm_bases
from mpp.objectives.mae import MaskedAutoencoder
from mpp.objectives.mpp import MPP_TARGETS, MaskedPatchPrediction
from mpp.ops import IMAGENET_MEAN, IMAGENET_STD

# name -> class, every registered objective (configs.py imported each module)
OBJECTIVES: dict[str, type[Objective]] = {n: REGISTRY[n][1] for n in OBJECTIVE_CONFIGS}


def create_objective(
    name: str,
    encoder: VisionTransformer,
    mask_generator: MaskGenerator | None = None,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
    **kwargs: Any,
) -> Objective:
    """The objective registered as ``name`` around ``encoder`` (timm's ``create_model`` for
    objectives), its arguments flat and checked by its typed section (the same as a config's
    ``objective``); ``mean``/``std`` are the data's. Unknown names or arguments raise ValueError
    naming them. A config builds through ``mpp.build.build_objective``."""
    cfg = parse_objective(name, kwargs)
    return REGISTRY[name][1].from_config(cfg, encoder, mask_generator, (mean, std))


__all__ = [
    "MPP_TARGETS",
    "OBJECTIVES",
    "OBJECTIVE_CONFIGS",
    "PRED_LOSSES",
    "REGISTRY",
    "HardPatchesMining",
    "MaskedAutoencoder",
    "MaskedPatchPrediction",
    "Objective",
    "ObjectiveConfig",
    "PerPatchObjective",
    "create_objective",
    "hpm_bases",
    "register",
]
