"""Frozen-encoder features and the weighted k-NN vote: what the k-NN probe, the linear probes
(``mpp.transfer.probe``) and the training monitor (``mpp.train.monitor``) share, so the monitor's
k-NN is the k-NN probe's.

A feature *slot* is one pooled feature of one block, ``(block, "token" | "avg")``: one forward
pass gives every slot asked for (``--layers all``: every block's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from mpp.models.vit import VisionTransformer

Slot = tuple[int, str]  # (block index, "token" | "avg")
# images per encoder forward: MAE's per-GPU probe batch; a 16384-image step in one forward
# would hold ~40 GB of ViT-B MLP activations in fp32
FORWARD_CHUNK = 512


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
    try:
        for batch in loader:
            feats.append(features.pool(encoder, batch["image"]).cpu())
            labels.append(batch["label"])
            keys += batch["key"]
    except Exception as e:  # a DataError on this rank: every rank ends, none left in the gather
        end_every_rank(e, world_size)
        raise
    end_every_rank(None, world_size)
    num_slots = len(features.slots)
    feats_cpu = torch.cat(feats) if feats else torch.empty(0, num_slots, encoder.embed_dim)
    labels_cpu = torch.cat(labels) if labels else torch.empty(0, dtype=torch.int64)
    feats_cpu, labels_cpu, _ = gather_in_key_order(feats_cpu, labels_cpu, keys, world_size)
    return place(feats_cpu, device), labels_cpu.to(device)


def end_every_rank(failed: Exception | None, world_size: int) -> None:
    """Whether any of the ``world_size`` ranks failed, agreed (a collective): every rank but the
    failing one (which re-raises its own) raises its error's class (``mpp.data.DataError``, say)
    with its message's last line, none left waiting in the next collective for a rank gone."""
    if world_size == 1:
        return
    import sys

    import torch.distributed as dist

    kind, every = type(failed), [None] * world_size
    line = str(failed).strip().splitlines()[-1:]  # a worker's error: a traceback's last line
    dist.all_gather_object(every, failed and (kind.__module__, kind.__qualname__, line))
    for r, said in enumerate(every):
        if said and failed is None:
            kind = getattr(sys.modules.get(said[0]), said[1], RuntimeError)
            raise kind(f"rank {r}: {''.join(said[2])}")


def gather_in_key_order(
    feats: Tensor, labels: Tensor, keys: list[str], world_size: int
) -> tuple[Tensor, Tensor, list[str]]:
    """Every rank's share (CPU tensors), gathered on every rank and sorted by sample key: the
    same order whatever the world size (a collective when ``world_size`` > 1)."""
    shares = [(feats, labels, keys)]
    if world_size > 1:
        import torch.distributed as dist

        shares = [None] * world_size
        dist.all_gather_object(shares, (feats, labels, keys))
    keys = [k for _, _, ks in shares for k in ks]
    order = torch.tensor(sorted(range(len(keys)), key=keys.__getitem__), dtype=torch.long)
    feats = torch.cat([f for f, _, _ in shares])[order]
    labels = torch.cat([y for _, y, _ in shares])[order]
    return feats, labels, [keys[i] for i in order]


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
