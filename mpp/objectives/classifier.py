"""Supervised classification as an objective (fine-tuning, docs/ARCHITECTURE.md §4.6): soft-target
cross-entropy under mixup / cutmix / label smoothing / random erasing while training, plain
cross-entropy and top-1 in eval mode."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mpp.data.augment import mixup_cutmix, random_erasing, soft_targets
from mpp.models.vit import VisionTransformer
from mpp.objectives.base import Objective


class Classifier(Objective):
    """``forward(images, labels) -> (loss, metrics)``: soft-target cross-entropy under the
    fine-tuning augmentations (training), plain cross-entropy + top-1 (evaluation)."""

    def __init__(
        self,
        encoder: VisionTransformer,
        label_smoothing: float = 0.1,
        mixup: float = 0.8,
        cutmix: float = 1.0,
        mixup_prob: float = 1.0,
        mixup_switch_prob: float = 0.5,
        reprob: float = 0.25,
        head_init_std: float = 2e-5,
    ) -> None:
        super().__init__()
        if encoder.num_classes < 1:
            raise ValueError("the classifier's encoder needs num_classes >= 1")
        self.encoder = encoder
        self.num_classes = encoder.num_classes
        # a fresh head; by default as MAE's fine-tuning makes it: tiny weights, so the first steps
        # do not push large random gradients into the pretrained blocks
        nn.init.trunc_normal_(encoder.head.weight, std=head_init_std)
        nn.init.zeros_(encoder.head.bias)
        self.label_smoothing, self.reprob = label_smoothing, reprob
        self.mixup, self.cutmix = mixup, cutmix
        self.mixup_prob, self.switch_prob = mixup_prob, mixup_switch_prob

    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()}

    def inputs(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return batch["image"], batch["label"]

    def forward(self, images: Tensor, labels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        if not self.training:
            logits = self.encoder(images)
            return F.cross_entropy(logits.float(), labels), {
                "acc": (logits.argmax(-1) == labels).float().mean()
            }
        targets = soft_targets(labels, self.num_classes, self.label_smoothing)
        images, targets, _ = mixup_cutmix(
            images, targets, self.mixup, self.cutmix, self.mixup_prob, self.switch_prob
        )
        images = random_erasing(images, self.reprob)
        logits = self.encoder(images).float()
        loss = torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()
        return loss, {
            "loss": loss.detach(),
            "acc": (logits.argmax(-1) == labels).float().mean().detach(),
        }
