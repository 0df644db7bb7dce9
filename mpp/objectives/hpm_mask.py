"""HPM's mask policy and its schedule (docs/ARCHITECTURE.md §4.4), next to HPM (mpp.objectives.hpm).

The teacher's hardest patches are masked first, a share alpha of the mask that grows from
easy to hard over training; the rest of the budget is random. Not a config's
``masking.strategy``: it needs a teacher's scores at every step, which only HPM has
(``objective.name="hpm"``). ``HardPatchMask`` is the same policy as a library mask generator,
for callers that bring their own scores.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mpp.masking import MaskGenerator, topk_mask

SCHEDULES = ("easy_to_hard", "hard_only", "hard_to_easy", "random")


def hard_ratio_at(
    schedule: str, epoch: float, total_epochs: float, hard_ratio: float = 0.5
) -> float:
    """alpha, the share of the mask chosen as the hardest patches, at (integer part of) ``epoch``.

    easy_to_hard: alpha_T (e+1)/T (the paper); hard_to_easy: alpha_T (T-e)/T, its reverse;
    hard_only: alpha_T always; random: 0 (plain MAE masking)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown HPM schedule {schedule!r}; allowed: {SCHEDULES}")
    e, T = math.floor(epoch), float(total_epochs)
    if schedule == "easy_to_hard":
        return hard_ratio * min((e + 1) / T, 1.0)
    if schedule == "hard_to_easy":
        return hard_ratio * max((T - e) / T, 0.0)
    return hard_ratio if schedule == "hard_only" else 0.0


def hard_patch_mask(
    scores: Tensor, num_masked: int, k: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """HPM's mask: the k highest-scoring patches always masked, ``num_masked - k`` more drawn
    uniformly from the rest. scores (B, N) -> mask (B, N) bool with exactly ``num_masked``
    True per row, and hard (B, N) bool, the top-k part of it. k = 0 is plain random masking.

    Batched: hard patches get noise 2 (above any U[0, 1) draw), then the top ``num_masked``
    of the noise are masked; the official code loops over samples on the CPU."""
    B, N = scores.shape
    if not 0 <= k <= num_masked <= N:
        raise ValueError(
            f"need 0 <= k <= num_masked <= N, got k={k}, num_masked={num_masked}, N={N}"
        )
    hard = topk_mask(scores, k)  # (B, N)
    noise = torch.rand(B, N, device=scores.device, generator=generator).masked_fill_(hard, 2.0)
    return topk_mask(noise, num_masked), hard


class HardPatchMask(MaskGenerator):
    """HPM's easy-to-hard mask: the ``int(num_masked * hard_ratio)`` patches with the highest
    predicted loss (``scores``, (B, N), e.g. from the teacher's loss predictor) are masked,
    the rest of the budget at random (``hard_patch_mask``). ``hard_ratio``
    0 is MAE's random mask; a schedule (α_e, §4.4) sets it per call or on the attribute."""

    def __init__(
        self, grid_size: tuple[int, int], mask_ratio: float, hard_ratio: float = 0.0
    ) -> None:
        super().__init__(grid_size, mask_ratio)
        self.hard_ratio = self._check_hard_ratio(hard_ratio)

    @staticmethod
    def _check_hard_ratio(hard_ratio: float) -> float:
        if not 0.0 <= hard_ratio <= 1.0:
            raise ValueError(f"hpm masking: hard_ratio must be in [0, 1], got {hard_ratio}")
        return hard_ratio

    def num_hard(self, hard_ratio: float | None = None) -> int:
        """k = int(n_mask * hard_ratio), as in HPM's code (floor)."""
        ratio = self.hard_ratio if hard_ratio is None else self._check_hard_ratio(hard_ratio)
        return int(self.num_masked * ratio)

    def __call__(
        self,
        batch_size,
        device="cpu",
        generator=None,
        *,
        scores: Tensor | None = None,
        hard_ratio: float | None = None,
        num_hard: int | None = None,
        return_hard: bool = False,
    ):
        k = self.num_hard(hard_ratio) if num_hard is None else num_hard
        if scores is None:
            if k > 0:
                raise ValueError(
                    f"hpm masking needs scores=(B, N) predicted losses to mask k={k} hard patches"
                )
            scores = torch.zeros(batch_size, self.num_patches, device=device)
        if tuple(scores.shape) != (batch_size, self.num_patches):
            raise ValueError(
                f"hpm masking: scores must be ({batch_size}, {self.num_patches}), got {tuple(scores.shape)}"
            )
        mask, hard = hard_patch_mask(
            scores.detach().float(), self.num_masked, k, generator=generator
        )
        return (mask, hard) if return_hard else mask
