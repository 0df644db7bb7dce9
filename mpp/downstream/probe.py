"""Frozen-encoder evaluations (DESIGN.md §4.6): features extracted once from center crops,
then linear probes (BatchNorm without affine + Linear, SGD, cosine) or a weighted k-NN vote
(cosine similarity, k = 20, temperature 0.07, as DINO's). k-NN and linear probes understate
pixel-MIM methods; fine-tuning is the main metric.

A feature *slot* is one pooled feature of one block, ``(block, "token" | "avg")``: one forward
pass gives every slot asked for (``--layers all``: every block's), and any number of linear
heads, each reading some slots, train together on the same batches (``HeadTrainer``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mpp.downstream.lars import LARS
from mpp.models.vit import VisionTransformer
from mpp.train.optim import lr_at

if TYPE_CHECKING:
    from mpp.config import ProbeSection

Slot = tuple[int, str]  # (block index, "token" | "avg")
# images per encoder forward: MAE's per-GPU probe batch; a 16384-image step in one forward
# would hold ~40 GB of ViT-B MLP activations in fp32
FORWARD_CHUNK = 512


def scaled_lr(base_lr: float, batch_size: int) -> float:
    """The linear scaling rule, base x batch / 256: MAE's lr from blr, DINOv2's scale_lr."""
    return base_lr * batch_size / 256


def feature_slots(depth: int, pool: str, layers: str = "last") -> list[Slot]:
    """The last block's ``pool`` feature, or every block's (``layers="all"``)."""
    return [(b, pool) for b in (range(depth) if layers == "all" else [depth - 1])]


def _keep(store: dict[int, Tensor], block: int, _module, _inputs, output: Tensor) -> None:
    store[block] = output


@torch.no_grad()
def pooled_features(encoder: VisionTransformer, images: Tensor, slots: Sequence[Slot]) -> Tensor:
    """Normalised images (B, C, H, W) -> features (B, S, D), one per slot: the block's tokens
    through the encoder's final norm (DINOv2's get_intermediate_layers(norm=True); the last
    block's are forward_features'), then the cls token or the mean of the patch tokens."""
    blocks = sorted({b for b, _ in slots})
    outputs: dict[int, Tensor] = {}
    hooks = [encoder.blocks[b].register_forward_hook(partial(_keep, outputs, b)) for b in blocks]
    prefix, chunks = encoder.num_prefix_tokens, []
    try:
        for part in images.split(FORWARD_CHUNK):
            encoder.forward_features(part)  # the hooks keep each wanted block's output
            tokens = {b: encoder.norm(outputs[b]) for b in blocks}  # (B, 1 + N, D) each
            pooled = [
                tokens[b][:, 0] if pool == "token" else tokens[b][:, prefix:].mean(1)
                for b, pool in slots
            ]
            chunks.append(torch.stack(pooled, 1).float())
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(chunks)


@dataclass(frozen=True)
class FeatureSpec:
    """What a feature of an image is: the uint8 image normalised by ``mean``/``std``, then one
    pooled feature per slot (``pooled_features``). The fast, k-NN and DINOv2 protocols take it
    from cached center crops (``extract_features``), MAE's from augmented ones (``mae_probe``)."""

    slots: Sequence[Slot]
    mean: Sequence[float]
    std: Sequence[float]

    def pool(self, encoder: VisionTransformer, images: Tensor) -> Tensor:
        """uint8 images (B, C, H, W), moved to the encoder's device -> features (B, S, D)."""
        from mpp.ops import normalize

        device = next(encoder.parameters()).device
        normalized = normalize(images.to(device, non_blocking=True), self.mean, self.std)
        return pooled_features(encoder, normalized, self.slots)


@torch.no_grad()
def extract_features(
    encoder: VisionTransformer, loader, features: FeatureSpec, *, world_size: int = 1
) -> tuple[Tensor, Tensor]:
    """(features (N, S, D), labels (N,)) over one exact pass of ``loader`` (this rank's share of
    the shards under the eval transform, with keys: ``make_eval_loader(shards, rank=...,
    world_size=..., with_keys=True)``), on the encoder's device when they fit (``place``). The
    ``world_size`` ranks' shares are gathered on every rank and put in sample-key order, so any
    number of ranks gives the same features in the same order (1.28M ImageNet images are hours
    on one GPU, days on a CPU)."""
    encoder.eval()
    device = next(encoder.parameters()).device
    feats, labels, keys = [], [], []
    for batch in loader:
        feats.append(features.pool(encoder, batch["image"]).cpu())
        labels.append(batch["label"])
        keys += batch["key"]
    num_slots = len(features.slots)
    feats_cpu = torch.cat(feats) if feats else torch.empty(0, num_slots, encoder.embed_dim)
    labels_cpu = torch.cat(labels) if labels else torch.empty(0, dtype=torch.int64)
    if world_size > 1:
        import torch.distributed as dist

        shares: list = [None] * world_size
        dist.all_gather_object(shares, (feats_cpu, labels_cpu, keys))
        feats_cpu = torch.cat([f for f, _, _ in shares])
        labels_cpu = torch.cat([y for _, y, _ in shares])
        keys = [k for _, _, ks in shares for k in ks]
    order = torch.tensor(sorted(range(len(keys)), key=keys.__getitem__), dtype=torch.long)
    return place(feats_cpu[order], device), labels_cpu[order].to(device)


def place(x: Tensor, device: torch.device) -> Tensor:
    """``x`` on ``device`` when it takes under half of the free memory there, else left on the
    host (every slot of ViT-B over ImageNet's train set is 47 GB in fp32): the probes move each
    batch to the device."""
    too_big = (
        device.type == "cuda"
        and x.numel() * x.element_size() > torch.cuda.mem_get_info(device)[0] / 2
    )
    return x if too_big else x.to(device)


def topk_accuracy(scores: Tensor, labels: Tensor) -> dict[str, float]:
    top = scores.topk(min(5, scores.shape[1]), dim=1).indices
    return {
        "top1": 100.0 * (top[:, 0] == labels).float().mean().item(),
        "top5": 100.0 * (top == labels.unsqueeze(1)).any(1).float().mean().item(),
    }


def knn_scores(
    train_x: Tensor,
    train_y: Tensor,
    test_x: Tensor,
    num_classes: int,
    k: int = 20,
    temperature: float = 0.07,
) -> Tensor:
    """(n_test, num_classes) votes: each of the k most cosine-similar training features votes for
    its class with weight exp(similarity / T) (DINO's weighted k-NN, k = 20, T = 0.07)."""
    device = test_x.device
    train_x, train_y = F.normalize(train_x.to(device), dim=1), train_y.to(device)
    test_x = F.normalize(test_x, dim=1)
    k = min(k, train_x.shape[0])
    scores = torch.zeros(test_x.shape[0], num_classes, device=device)
    for start in range(0, test_x.shape[0], 1024):  # chunks bound the (n, N_train) similarity matrix
        sim = test_x[start : start + 1024] @ train_x.T
        top_sim, top_idx = sim.topk(k, dim=1)
        votes = torch.zeros(sim.shape[0], num_classes, device=device)
        votes.scatter_add_(1, train_y[top_idx], (top_sim / temperature).exp())
        scores[start : start + 1024] = votes
    return scores


def knn_classify(
    train_x: Tensor,
    train_y: Tensor,
    test_x: Tensor,
    test_y: Tensor,
    num_classes: int,
    k: int = 20,
    temperature: float = 0.07,
) -> dict[str, float]:
    """Top-1/top-5 of the weighted k-NN vote (``knn_scores``)."""
    return topk_accuracy(
        knn_scores(train_x, train_y, test_x, num_classes, k, temperature), test_y.to(test_x.device)
    )


class LinearHead(nn.Module):
    """MAE's linear probe head: BatchNorm1d(affine=False, eps=1e-6) then Linear, weight
    trunc_normal_(std=0.01), bias 0 (main_linprobe.py)."""

    def __init__(
        self, dim: int, num_classes: int, generator: torch.Generator | None = None
    ) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(dim, affine=False, eps=1e-6)
        self.fc = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.fc.weight, std=0.01, generator=generator)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.bn(x))


@dataclass
class Probe:
    """One linear head reading the concatenation of some feature slots, at its own peak lr."""

    name: str
    slots: list[int]  # indices into the features' slot axis, concatenated in this order
    lr: float
    head: nn.Module
    facts: dict = field(default_factory=dict)  # what results.json says of it (lr, blocks, pooling)

    def inputs(self, feats: Tensor) -> Tensor:
        """(B, S, D) -> (B, len(slots) * D)."""
        return feats[:, self.slots].flatten(1)


class HeadTrainer:
    """Heads trained together on the same batches, each with its own peak lr on one schedule
    (linear warm-up, then cosine to 0; MAE's per-iteration rule): one pass over the features
    serves a whole grid (DINOv2's linear evaluation). The loss is the sum of the heads' losses,
    so each head gets exactly the gradient it would get alone."""

    def __init__(
        self,
        probes: list[Probe],
        *,
        total_steps: int,
        warmup_steps: int,
        momentum: float,
        weight_decay: float,
        optimizer: str = "sgd",
    ) -> None:
        self.probes, self.heads = probes, nn.ModuleList(p.head for p in probes)
        groups = [{"params": list(p.head.parameters()), "peak": p.lr} for p in probes]
        if optimizer == "lars":
            self.optimizer = LARS(groups, weight_decay=weight_decay, momentum=momentum)
        else:
            self.optimizer = torch.optim.SGD(
                groups, lr=0.0, momentum=momentum, weight_decay=weight_decay
            )
        self.total, self.warmup, self.steps = total_steps, warmup_steps, 0
        self.last_losses = torch.full((len(probes),), float("nan"))  # each head's, at its last step

    def step(self, feats: Tensor, labels: Tensor) -> None:
        """One optimiser step of every head on features (B, S, D); a batch of one is skipped
        (BatchNorm needs two samples)."""
        if labels.numel() < 2:
            return
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(
                self.steps, peak=group["peak"], total=self.total, warmup=self.warmup
            )
        self.heads.train()
        # each distinct input built once: the grid's 13 learning rates share one
        inputs = {s: feats[:, list(s)].flatten(1) for s in {tuple(p.slots) for p in self.probes}}
        losses = [F.cross_entropy(p.head(inputs[tuple(p.slots)]), labels) for p in self.probes]
        self.optimizer.zero_grad()
        sum(losses).backward()
        self.optimizer.step()
        self.steps += 1
        self.last_losses = torch.stack(losses).detach()

    @torch.no_grad()
    def evaluate(self, feats: Tensor, labels: Tensor) -> list[dict[str, float]]:
        """Top-1/top-5 of every head on (N, S, D) features, in the probes' order."""
        self.heads.eval()
        device = next(self.heads.parameters()).device
        scores: list[list[Tensor]] = [[] for _ in self.probes]
        for start in range(0, len(labels), 8192):
            x = feats[start : start + 8192].to(device)
            for i, p in enumerate(self.probes):
                scores[i].append(p.head(p.inputs(x)))
        return [topk_accuracy(torch.cat(s), labels.to(device)) for s in scores]


def train_on_features(
    trainer: HeadTrainer, x: Tensor, y: Tensor, *, epochs: int, batch_size: int, seed: int
) -> None:
    """``epochs`` shuffled passes over cached features (N, S, D); the order depends on ``seed``
    alone (a CPU generator: the same on any device)."""
    g = torch.Generator().manual_seed(seed)
    device = next(trainer.heads.parameters()).device
    for _ in range(epochs):
        order = torch.randperm(x.shape[0], generator=g)
        for start in range(0, x.shape[0], batch_size):
            idx = order[start : start + batch_size]
            trainer.step(x[idx.to(x.device)].to(device), y[idx.to(y.device)].to(device))


def linear_probes(
    train_x: Tensor,
    train_y: Tensor,
    val_x: Tensor,
    val_y: Tensor,
    num_classes: int,
    *,
    settings: ProbeSection,
    seed: int,
) -> list[dict[str, float]]:
    """A BatchNorm + Linear head per slot of the cached features (N, S, D), all trained in one
    pass with SGD (lr = blr x batch / 256, warm-up + cosine); top-1/top-5 of the last epoch on
    ``val`` per slot. Each head starts from ``seed``, as it would alone. ``settings``: the probe
    section's epochs, batch_size, blr, momentum, weight_decay and warmup_epochs."""
    epochs, batch_size = settings.epochs, settings.batch_size
    device = train_y.device
    peak = scaled_lr(settings.blr, batch_size)
    dim, slots = train_x.shape[2], range(train_x.shape[1])
    probes = [
        Probe(
            f"slot{s}", [s], peak, LinearHead(dim, num_classes, torch.Generator().manual_seed(seed))
        )
        for s in slots
    ]
    for p in probes:
        p.head.to(device)
    steps_per_epoch = max(1, -(-train_x.shape[0] // batch_size))
    trainer = HeadTrainer(
        probes,
        total_steps=epochs * steps_per_epoch,
        warmup_steps=settings.warmup_epochs * steps_per_epoch,
        momentum=settings.momentum,
        weight_decay=settings.weight_decay,
    )
    train_on_features(trainer, train_x, train_y, epochs=epochs, batch_size=batch_size, seed=seed)
    losses = trainer.last_losses.tolist()
    return [
        {**r, "train_loss": loss}
        for r, loss in zip(trainer.evaluate(val_x, val_y), losses, strict=True)
    ]


def linear_probe(
    train_x: Tensor,
    train_y: Tensor,
    val_x: Tensor,
    val_y: Tensor,
    num_classes: int,
    *,
    settings: ProbeSection,
    seed: int,
) -> dict[str, float]:
    """``linear_probes`` on one feature per sample (N, D)."""
    return linear_probes(
        train_x[:, None],
        train_y,
        val_x[:, None],
        val_y,
        num_classes,
        settings=settings,
        seed=seed,
    )[0]
