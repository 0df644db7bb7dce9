"""Pretraining objectives: each an nn.Module with ``forward(images) -> (loss, metrics)``."""

from mpp.objectives.base import Objective
from mpp.objectives.mpp import MPP_TARGETS, MaskedPatchPrediction

OBJECTIVES = {"mpp": MaskedPatchPrediction}

__all__ = ["MPP_TARGETS", "MaskedPatchPrediction", "OBJECTIVES", "Objective"]
