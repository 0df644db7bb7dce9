"""Linear probes on a frozen encoder (docs/ARCHITECTURE.md §4.6): BatchNorm without affine + Linear, SGD
(or LARS), cosine, on features extracted once from center crops (``mpp.features``, where the
weighted k-NN vote lives too). k-NN and linear probes understate pixel-MIM methods; fine-tuning
is the main metric. Any number of linear heads, each reading some feature slots, train together
on the same batches (``HeadTrainer``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mpp.features import topk_accuracy
from mpp.train.optim import lr_at

if TYPE_CHECKING:
    from mpp.config import ProbeSection


def scaled_lr(base_lr: float, batch_size: int) -> float:
    """The linear scaling rule, base x batch / 256: MAE's lr from blr, DINOv2's scale_lr."""
    return base_lr * batch_size / 256


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

    slots: list[int]  # indices into the features' slot axis, concatenated in this order
    lr: float
    head: nn.Module
    facts: dict = field(default_factory=dict)  # what results.json says of it (lr, blocks, pooling)

    def inputs(self, feats: Tensor) -> Tensor:
        """(B, S, D) -> (B, len(slots) * D)."""
        return feats[:, self.slots].flatten(1)


def trust_ratio(param: Tensor, update: Tensor, eta: float) -> Tensor:
    """eta * ||w|| / ||update||, or 1 when either norm is 0 (a zero-initialised weight, or no
    gradient: MAE's torch.where guards)."""
    param_norm, update_norm = torch.linalg.vector_norm(param), torch.linalg.vector_norm(update)
    one = torch.ones_like(param_norm)
    return torch.where(
        param_norm > 0, torch.where(update_norm > 0, eta * param_norm / update_norm, one), one
    )


class LARS(torch.optim.Optimizer):
    """LARS (You et al., 2017, arXiv:1708.03888) as MAE's linear probe uses it (MAE's
    util/lars.py): momentum SGD whose update of each matrix is rescaled by the trust ratio
    eta * ||w|| / ||g||; biases and other 1-D parameters (BatchNorm's, were it affine) take the
    plain momentum step. Per step, for a parameter w with gradient g in a group (lr, weight_decay,
    momentum, eta):
    d = g + weight_decay * w, scaled by ``trust_ratio(w, d, eta)`` when w.ndim > 1;
    mu = momentum * mu + d; w -= lr * mu. MAE's probe: weight_decay 0, momentum 0.9, eta 0.001."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.0,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        trust_coefficient: float = 0.001,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None) -> None:  # closure: the Optimizer signature; unused
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad
                # not a bias or a norm's gamma/beta: weight decay and the trust ratio
                if p.ndim > 1:
                    update = update.add(p, alpha=group["weight_decay"])
                    update = update.mul(trust_ratio(p, update, group["trust_coefficient"]))
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mu = state["mu"]
                mu.mul_(group["momentum"]).add_(update)
                p.add_(mu, alpha=-group["lr"])


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
        device: torch.device | None = None,  # where the heads train (None: where they are)
    ) -> None:
        self.probes, self.heads = probes, nn.ModuleList(p.head for p in probes).to(device)
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
    ``val`` per slot. Each head starts from ``seed``, as it would alone."""
    epochs, batch_size = settings.epochs, settings.batch_size
    peak = scaled_lr(settings.blr, batch_size)
    dim, slots = train_x.shape[2], range(train_x.shape[1])
    probes = [
        Probe([s], peak, LinearHead(dim, num_classes, torch.Generator().manual_seed(seed)))
        for s in slots
    ]
    steps_per_epoch = max(1, -(-train_x.shape[0] // batch_size))
    trainer = HeadTrainer(
        probes,
        total_steps=epochs * steps_per_epoch,
        warmup_steps=settings.warmup_epochs * steps_per_epoch,
        momentum=settings.momentum,
        weight_decay=settings.weight_decay,
        device=train_y.device,
    )
    train_on_features(trainer, train_x, train_y, epochs=epochs, batch_size=batch_size, seed=seed)
    losses = trainer.last_losses.tolist()
    return [
        {**r, "train_loss": loss}
        for r, loss in zip(trainer.evaluate(val_x, val_y), losses, strict=True)
    ]
