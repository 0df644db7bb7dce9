"""Pretraining objectives: each an nn.Module with ``forward(images) -> (loss, metrics)``."""

import inspect

from mpp.models.vit import VisionTransformer
from mpp.objectives.base import Objective
from mpp.objectives.hpm import HPM_BASES, PRED_LOSSES, HardPatchesMining
from mpp.objectives.mae import MaskedAutoencoder
from mpp.objectives.mpp import MPP_TARGETS, MaskedPatchPrediction

OBJECTIVES: dict[str, type[Objective]] = {
    "mpp": MaskedPatchPrediction,
    "mae": MaskedAutoencoder,
    "hpm": HardPatchesMining,
}


def create_objective(name: str, encoder: VisionTransformer, **kwargs) -> Objective:
    """The objective registered as ``name`` around ``encoder`` (timm's ``create_model`` for
    objectives; a config builds through ``mpp.build.build_objective``); unknown names or
    arguments raise ValueError naming what is allowed."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; allowed: {sorted(OBJECTIVES)}")
    cls = OBJECTIVES[name]
    params = inspect.signature(cls).parameters
    # a class taking **kwargs (hpm: its base's arguments) checks them itself
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        allowed = set(params) - {"encoder"}
        unknown = sorted(set(kwargs) - allowed)
        if unknown:
            raise ValueError(
                f"unknown argument(s) {unknown} for objective {name!r}; allowed: {sorted(allowed)}"
            )
    return cls(encoder, **kwargs)


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
