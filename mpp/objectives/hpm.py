"""HPM, hard patches mining (Wang et al., 2304.05919, CVPR 2023; docs/ARCHITECTURE.md §4.4).

A wrapper around any objective with a per-patch loss (``base``: MAE's reconstruction MSE,
as in the paper, or the BERT-style MPP's cross-entropy). The student gets a second decoder,
the loss predictor, that scores every patch; an EMA teacher of the whole student scores the
fully visible image, and the patches it predicts to be hardest are masked, easy to hard:
a growing share alpha of the mask is the teacher's top-k, the rest stays random. The
predictor learns which patch is harder than which from the detached per-patch losses.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn

from mpp.masking import MaskGenerator
from mpp.models.decoder import Decoder
from mpp.models.vit import VisionTransformer
from mpp.objectives.base import REGISTRY, Objective, PerPatchObjective, Pixels, Section, register
from mpp.objectives.hpm_mask import SCHEDULES, hard_patch_mask, hard_ratio_at
from mpp.objectives.mae import DecoderSize, MAEBase
from mpp.ops import IMAGENET_MEAN, IMAGENET_STD, gather_tokens
from mpp.parallel.ema import EMA

PRED_LOSSES = ("ranking", "mse")
# what the teacher scores to choose the hard patches: the fully visible image (the paper and its
# code), or views that mask each patch as training does (the predictor is only ever trained on
# masked patches; on the built-in data it ranks visible ones inversely, docs/ARCHITECTURE.md)
TEACHER_VIEWS = ("visible", "masked")


def hpm_bases() -> dict[str, type[PerPatchObjective]]:
    """What HPM can wrap: every registered objective with a per-patch loss
    (mpp.objectives.base.PerPatchObjective)."""
    return {n: c for n, (_, c) in REGISTRY.items() if issubclass(c, PerPatchObjective)}


class HPMConfig(Section, DecoderSize):
    """HPM (mpp.objectives.hpm) around ``base``; it chooses its masks itself (its teacher).

    The decoder's size is HPM's: its loss predictor and, for MAE, the base's pixel decoder share
    it, so the nested base does not repeat it. The flat form of the shipped configs (``"base":
    "mae"`` with the base's keys beside HPM's) is read too and nested."""

    name: Literal["hpm"] = "hpm"
    """The objective: hpm."""
    # the union of the per-patch objectives' ``base_section``s, set by mpp.objectives.configs
    # once every objective is registered (``model_rebuild``)
    base: PerPatchSection = Field(default_factory=MAEBase, discriminator="name")  # noqa: F821
    """The objective HPM wraps, with its keys: mae (the paper's) or any per-patch objective."""
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

    def base_config(self) -> Section:
        """The base's full section: its nested keys, and those its ``base_section`` leaves to
        HPM (MAE's decoder size) taken from HPM's."""
        section = REGISTRY[self.base.name][0]
        shared = set(section.model_fields) - set(type(self.base).model_fields)
        return section.model_validate({**self.model_dump(include=shared), **self.base.model_dump()})


# ---- schedules ------------------------------------------------------------------------------


def momentum_at(
    epoch: float, start: float = 0.999, end: float = 0.9999, ramp_epochs: float = 100.0
) -> float:
    """Teacher EMA momentum: linear from ``start`` to ``end`` over the first ``ramp_epochs``, then held."""
    if ramp_epochs <= 0:
        return end
    return start + (end - start) * min(max(epoch, 0.0) / ramp_epochs, 1.0)


def num_views(num_patches: int, num_masked: int) -> int:
    """How many ``masked_views`` cover every patch as masked at least once."""
    n_vis = num_patches - num_masked
    return -(-num_patches // n_vis) + (num_patches % n_vis > 0)


def masked_views(batch: int, num_patches: int, num_masked: int, device) -> Tensor:
    """Masks (V, B, N), each with exactly ``num_masked`` True, whose visible sets run along a
    random permutation of the patches, wrapping around: V = N / N_vis views when N_vis divides N
    (each patch masked in V - 1 of them; MAE's 75 %: 4 views, which together cost the encoder
    one fully visible image), one more otherwise, so that every patch is masked in one at least."""
    n_vis = num_patches - num_masked
    views = num_views(num_patches, num_masked)
    order = torch.rand(batch, num_patches, device=device).argsort(dim=1)  # (B, N)
    order = torch.cat([order, order], dim=1)  # the last view wraps around
    masks = torch.ones(views, batch, num_patches, dtype=torch.bool, device=device)
    for v in range(views):
        masks[v].scatter_(1, order[:, v * n_vis : (v + 1) * n_vis], False)
    return masks


# ---- the loss predictor's objective -----------------------------------------------------------


def ranking_loss(pred: Tensor, target: Tensor) -> Tensor:
    """HPM's relative loss: BCE on every ordered pair (i, j) of one image's patches that
    pred_j > pred_i iff target_j > target_i. pred, target (B, n); ties and i = j excluded,
    normalised by the number of untied ordered pairs in the batch.

    Where it differs from the official ``-pos*log(sigmoid(d) + 1e-6) - neg*log(1 - sigmoid(d) + 1e-6)``
    (deliberately): ``logsigmoid`` has no 1e-6 floor, so a badly wrong pair costs its true
    -log sigmoid(d) instead of being capped at -log(1e-6) ~ 13.8, and its gradient does not
    vanish there; and a batch whose pairs are all tied gives 0 (the count is clamped to 1)
    where the official division by zero valid pairs gives NaN. Equal elsewhere to ~1e-6."""
    diff = pred.unsqueeze(1) - pred.unsqueeze(2)  # (B, n, n): [b, i, j] = p_j - p_i
    harder = target.unsqueeze(1) > target.unsqueeze(2)  # l_j > l_i
    easier = target.unsqueeze(1) < target.unsqueeze(2)
    # log(1 - sigmoid(x)) = logsigmoid(-x)
    loss = -(harder * F.logsigmoid(diff) + easier * F.logsigmoid(-diff))
    return loss.sum() / (harder | easier).sum().clamp(min=1)


def zscore_mse_loss(pred: Tensor, target: Tensor, eps: float = 1e-6) -> Tensor:
    """The paper's ablation: MSE against the per-image z-scored target (B, n)."""
    mean, var = target.mean(dim=1, keepdim=True), target.var(dim=1, keepdim=True)
    target = (target - mean) / (var + eps) ** 0.5
    return (pred - target).pow(2).mean()


def rank_correlation(a: Tensor, b: Tensor) -> Tensor:
    """Spearman's rho per row of (B, n) inputs -> (B,): Pearson correlation of the ranks."""
    ra = a.argsort(dim=1).argsort(dim=1).float()
    rb = b.argsort(dim=1).argsort(dim=1).float()
    ra, rb = ra - ra.mean(dim=1, keepdim=True), rb - rb.mean(dim=1, keepdim=True)
    return (ra * rb).sum(dim=1) / (ra.norm(dim=1) * rb.norm(dim=1)).clamp(min=1e-12)


# ---- the objective ------------------------------------------------------------------------------


@register(HPMConfig)
class HardPatchesMining(Objective):
    """HPM around ``base``, a built objective with a per-patch loss (its encoder is HPM's):
    ``forward(images) -> (loss, metrics)``; the engine must call ``set_progress`` before each
    micro-step and ``after_optimizer_step`` after each optimiser step (the EMA teacher). By
    name and flat arguments: ``create_objective("hpm", encoder, base="mae", mask_ratio=0.75)``;
    from a config: ``from_config(HPMConfig, encoder, None, pixels)``. The decoder's size is the
    loss predictor's (and, built through those, an MAE base's pixel decoder's)."""

    def __init__(
        self,
        base: PerPatchObjective,
        cfg: HPMConfig,
        pixels: Pixels = (IMAGENET_MEAN, IMAGENET_STD),
    ) -> None:
        """HPM of section ``cfg`` (its own keys; ``cfg.base`` is ``base``'s) around ``base``;
        ``pixels``: the data's (mean, std)."""
        super().__init__()
        if not isinstance(base, PerPatchObjective):
            raise ValueError(
                "HPM wraps an objective with a per-patch loss (mpp.objectives.base."
                f"PerPatchObjective: {sorted(hpm_bases())}), got {type(base).__name__}"
            )
        self.base = base
        # the loss predictor is the size of the pixel decoder, fed what the base hands it
        self.predictor = Decoder(
            cfg.decoder_dim,
            cfg.decoder_depth,
            cfg.decoder_heads,
            out_dim=1,
            in_dim=self.base.token_dim,
            mlp_ratio=cfg.mlp_ratio,
            attn_backend=cfg.attn_backend,
        )
        self.num_masked = self.base.mask_generator.num_masked
        self.mean, self.std = tuple(pixels[0]), tuple(pixels[1])  # to show the images (tools.viz)
        self.hard_ratio, self.schedule = cfg.hard_ratio, cfg.schedule
        self.pred_loss, self.pred_weight = cfg.pred_loss, cfg.pred_weight
        self.momentum_start, self.momentum_end = cfg.momentum_start, cfg.momentum_end
        self.momentum_epochs = cfg.momentum_epochs
        self.teacher_view = cfg.teacher_view

        self.teacher = self.make_teacher()
        self.set_progress(0.0, 1.0)  # the engine overrides this before the first step

    @classmethod
    def from_config(
        cls,
        cfg: HPMConfig,
        encoder: VisionTransformer,
        mask_generator: MaskGenerator | None,
        pixels: Pixels,
    ) -> HardPatchesMining:
        """HPM around its base built on ``encoder``; ``mask_generator`` must be None (the
        teacher masks)."""
        if mask_generator is not None:
            raise ValueError("hpm chooses its own masks (its teacher): pass no mask generator")
        base_cls = REGISTRY[cfg.base.name][1]
        return cls(base_cls.from_config(cfg.base_config(), encoder, None, pixels), cfg, pixels)

    def make_teacher(self) -> nn.ModuleDict:
        """The EMA of the whole student, frozen. A submodule, so it is checkpointed (and
        ZeRO-partitioned, like the student: same shapes) with the rest."""
        teacher = nn.ModuleDict(
            {"base": copy.deepcopy(self.base), "predictor": copy.deepcopy(self.predictor)}
        )
        teacher.requires_grad_(False).eval()
        # paired by name once; the EMA looks the Parameters up after the engine has wrapped them
        self.ema = EMA(self, [(f"teacher.{n}", n) for n, _ in teacher.named_parameters()])
        self.register_load_state_dict_post_hook(HardPatchesMining._reset_ema)
        return teacher

    @staticmethod
    def _reset_ema(module: HardPatchesMining, incompatible_keys) -> None:
        module.ema.reset()  # a load may assign new Parameters and replaces the averaged weights

    @property
    def encoder(self) -> VisionTransformer:
        return self.base.encoder

    def train(self, mode: bool = True) -> HardPatchesMining:
        super().train(mode)
        self.teacher.eval()  # the teacher only ever scores
        return self

    def no_weight_decay(self) -> set[str]:
        return {f"base.{n}" for n in self.base.no_weight_decay()}

    def set_pixel_stats(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.mean, self.std = tuple(mean), tuple(std)
        for base in (self.base, self.teacher["base"]):
            base.set_pixel_stats(mean, std)

    # ---- per-step state -----------------------------------------------------------------------

    def set_progress(self, epoch: float, total_epochs: float) -> None:
        if total_epochs <= 0:
            raise ValueError(f"total_epochs must be > 0, got {total_epochs}")
        self.alpha = hard_ratio_at(self.schedule, epoch, total_epochs, self.hard_ratio)
        self.num_hard = int(self.num_masked * self.alpha)  # k
        # once per epoch, like alpha and like the official code (its momentum is set per epoch)
        self.teacher_momentum = momentum_at(
            math.floor(epoch), self.momentum_start, self.momentum_end, self.momentum_epochs
        )

    def after_optimizer_step(self) -> None:
        self.update_teacher()

    @torch.no_grad()
    def weights_loaded(self) -> None:
        """The teacher starts as a copy of the (newly loaded) student, as at construction."""
        self.teacher["base"].load_state_dict(self.base.state_dict())
        self.teacher["predictor"].load_state_dict(self.predictor.state_dict())

    def update_teacher(self) -> None:
        """theta_t <- m theta_t + (1 - m) theta_s over the whole student (``mpp.parallel.ema``)."""
        self.ema.update(self.teacher_momentum)

    def rank_state(self) -> dict[str, Tensor]:
        return self.ema.rank_state()  # the fp32 EMA under bf16, per rank

    def load_rank_state(self, state: dict[str, Tensor]) -> None:
        self.ema.load_rank_state(state)

    # ---- the algorithm, one step a method -----------------------------------------------------

    def predict_loss(self, tokens: Tensor, predictor: nn.Module) -> Tensor:
        """Predictor input tokens (B, 1 + N, Dt) -> one score per patch (B, N), fp32."""
        return predictor(tokens)[:, self.encoder.num_prefix_tokens :, 0].float()

    @torch.no_grad()
    def teacher_scores(self, images: Tensor) -> Tensor:
        """The teacher's predicted loss of every patch (B, N): of the fully visible image
        (``teacher_view="visible"``), or averaged over ``masked_views`` (``"masked"``)."""
        base, predictor = self.teacher["base"], self.teacher["predictor"]
        if self.teacher_view == "visible":
            return self.predict_loss(base.predictor_tokens(images), predictor)
        masks = masked_views(
            images.shape[0], self.encoder.num_patches, self.num_masked, images.device
        )
        V = masks.shape[0]
        tokens = base.predictor_tokens(images.repeat(V, 1, 1, 1), masks.flatten(0, 1))
        scores = self.predict_loss(tokens, predictor).view(masks.shape)  # (V, B, N)
        return (scores * masks).sum(0) / masks.sum(0)

    def hard_patch_masking(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """mask (B, N) with the teacher's k = int(alpha n_mask) hardest patches; hard (B, N) marks them."""
        B, N = images.shape[0], self.encoder.num_patches
        # k = 0 is plain random masking: skip the teacher's forward
        scores = self.teacher_scores(images) if self.num_hard > 0 else images.new_zeros(B, N)
        return hard_patch_mask(scores, self.num_masked, self.num_hard)

    def forward_pred_loss(self, pred: Tensor, target: Tensor) -> Tensor:
        """L_pred on the masked patches: pred, target (B, N_mask); the target is detached."""
        if self.pred_loss == "ranking":
            return ranking_loss(pred, target.detach())
        return zscore_mse_loss(pred, target.detach())

    def held_out_metrics(self, images: Tensor) -> dict[str, Tensor]:
        """Whether the loss predictor learns: Spearman's rank correlation between the student's
        predicted and the true per-patch loss over each image's masked patches (random masks, so
        it does not depend on the teacher); the same for the teacher's scores (of its
        ``teacher_view``), the ones that choose the hard patches (``teacher_rank_corr``); and the
        base's own signal under those masks."""
        out = self.base.forward_per_patch(images)
        pred = gather_tokens(self.predict_loss(out["tokens"], self.predictor), out["idx"])
        teacher = gather_tokens(self.teacher_scores(images), out["idx"])
        return {
            "rank_corr": rank_correlation(pred, out["loss"]),
            "teacher_rank_corr": rank_correlation(teacher, out["loss"]),
            **self.base.per_image_metrics(out),
        }

    def forward(self, images: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        mask, _ = self.hard_patch_masking(images)
        out = self.base.forward_per_patch(images, mask)  # loss (B, N_mask) at idx (B, N_mask)
        scores = self.predict_loss(out["tokens"], self.predictor)  # (B, N)
        pred = gather_tokens(scores, out["idx"])  # (B, N_mask)
        loss_rec = out["loss"].mean()
        loss_pred = self.forward_pred_loss(pred, out["loss"])
        loss = loss_rec + self.pred_weight * loss_pred

        def scalar(v: float) -> Tensor:  # a fill kernel on the device: no host-to-device copy
            return torch.full((), v, device=images.device)

        metrics = {
            "loss": loss.detach(),
            "loss_rec": loss_rec.detach(),
            "loss_pred": loss_pred.detach(),
            "rank_corr": rank_correlation(pred.detach(), out["loss"].detach()).mean(),
            "alpha": scalar(self.alpha),
            "teacher_momentum": scalar(self.teacher_momentum),
        }
        return loss, metrics
