"""Frozen-encoder evaluations (DESIGN.md §4.6): features extracted once from center crops,
then a linear probe (BatchNorm without affine + Linear, SGD, cosine) or a weighted k-NN vote
(cosine similarity, k = 20, temperature 0.07, as DINO's). k-NN and linear probes understate
pixel-MIM methods; fine-tuning is the main metric."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mpp.models.vit import VisionTransformer


@torch.no_grad()
def extract_features(
    encoder: VisionTransformer, shards, *, img_size: int, batch_size: int, mean, std, pool: str = "token",
    num_workers: int = 1, allow_pipe: bool = False, rank: int = 0, world_size: int = 1,
) -> tuple[Tensor, Tensor]:
    """(features (N, D), labels (N,)) over one exact pass of ``shards`` (eval transform), on the
    encoder's device. Each rank reads its share of the shards; the shares are gathered on every
    rank and put in sample-key order, so any number of ranks gives the same features in the same
    order (1.28M ImageNet images are hours on one GPU, days on a CPU)."""
    from mpp.data import make_eval_loader
    from mpp.ops import normalize

    encoder.eval()
    device = next(encoder.parameters()).device
    feats, labels, keys = [], [], []
    loader = make_eval_loader(shards, batch_size=batch_size, img_size=img_size, num_workers=num_workers,
                              allow_pipe=allow_pipe, rank=rank, world_size=world_size, with_keys=True)  # fmt: skip
    for batch in loader:
        tokens = encoder.forward_features(normalize(batch["image"].to(device, non_blocking=True), mean, std))
        feats.append((tokens[:, 0] if pool == "token" else tokens[:, encoder.num_prefix_tokens :].mean(1)).float())
        labels.append(batch["label"])
        keys += batch["key"]
    dim = encoder.embed_dim
    feats_cpu = torch.cat(feats).cpu() if feats else torch.empty(0, dim)
    labels_cpu = torch.cat(labels) if labels else torch.empty(0, dtype=torch.int64)
    if world_size > 1:
        import torch.distributed as dist

        shares: list = [None] * world_size
        dist.all_gather_object(shares, (feats_cpu, labels_cpu, keys))
        feats_cpu = torch.cat([f for f, _, _ in shares])
        labels_cpu = torch.cat([y for _, y, _ in shares])
        keys = [k for _, _, ks in shares for k in ks]
    order = torch.tensor(sorted(range(len(keys)), key=keys.__getitem__), dtype=torch.long)
    return feats_cpu[order].to(device), labels_cpu[order].to(device)


def topk_accuracy(scores: Tensor, labels: Tensor) -> dict[str, float]:
    top = scores.topk(min(5, scores.shape[1]), dim=1).indices
    return {
        "top1": 100.0 * (top[:, 0] == labels).float().mean().item(),
        "top5": 100.0 * (top == labels.unsqueeze(1)).any(1).float().mean().item(),
    }


def knn_classify(
    train_x: Tensor, train_y: Tensor, test_x: Tensor, test_y: Tensor, num_classes: int, k: int = 20, temperature: float = 0.07
) -> dict[str, float]:
    """Weighted k-NN: each of the k most cosine-similar training features votes for its class
    with weight exp(similarity / T)."""
    train_x, test_x = F.normalize(train_x, dim=1), F.normalize(test_x, dim=1)
    k = min(k, train_x.shape[0])
    scores = torch.zeros(test_x.shape[0], num_classes, device=test_x.device)
    for start in range(0, test_x.shape[0], 1024):  # chunks bound the (n, N_train) similarity matrix
        sim = test_x[start : start + 1024] @ train_x.T
        top_sim, top_idx = sim.topk(k, dim=1)
        votes = torch.zeros(sim.shape[0], num_classes, device=sim.device)
        votes.scatter_add_(1, train_y[top_idx], (top_sim / temperature).exp())
        scores[start : start + 1024] = votes
    return topk_accuracy(scores, test_y)


class LinearHead(nn.Module):
    """MAE's linear probe head: BatchNorm1d(affine=False) then Linear."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(dim, affine=False, eps=1e-6)
        self.fc = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.fc.weight, std=0.01)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.bn(x))


def linear_probe(
    train_x: Tensor, train_y: Tensor, val_x: Tensor, val_y: Tensor, num_classes: int, *, epochs: int = 90,
    batch_size: int = 256, blr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
    warmup_epochs: int = 10, seed: int = 0,
) -> dict[str, float]:
    """Train the head with SGD (lr = blr x batch / 256, warm-up + cosine) on the cached
    features; top-1/top-5 of the last epoch on ``val``."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = LinearHead(train_x.shape[1], num_classes).to(train_x.device)
    peak = blr * batch_size / 256
    opt = torch.optim.SGD(head.parameters(), lr=peak, momentum=momentum, weight_decay=weight_decay)
    steps_per_epoch = max(1, math.ceil(train_x.shape[0] / batch_size))
    total, warmup = epochs * steps_per_epoch, warmup_epochs * steps_per_epoch
    step = 0
    for _ in range(epochs):
        head.train()
        order = torch.randperm(train_x.shape[0], generator=g).to(train_x.device)  # the same on any device
        for start in range(0, train_x.shape[0], batch_size):
            idx = order[start : start + batch_size]
            if idx.numel() < 2:  # BatchNorm needs two samples
                continue
            lr = peak * step / warmup if step < warmup else 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
            for group in opt.param_groups:
                group["lr"] = lr
            loss = F.cross_entropy(head(train_x[idx]), train_y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
    head.eval()
    with torch.no_grad():
        return {**topk_accuracy(head(val_x), val_y), "train_loss": loss.item()}


# ---- the two command-line tools (downstream/linear_probe.py, downstream/knn.py) -------------


def run_probe(kind: str, argv: list[str] | None = None) -> int:
    """``kind`` = "linear" or "knn": parse, load the encoder from ``init``, extract features on
    every rank (``deepspeed --num_gpus N`` / torchrun; one process otherwise) and the GPU when
    there is one, evaluate on rank 0, write results.json. Exit status 2 on a bad config or init."""
    import json
    import sys

    from mpp.cli import config_from_args, open_run_dir, run_parser
    from mpp.config import ConfigError, ProbeConfig
    from mpp.distributed import init_distributed, world_from_env
    from mpp.runlock import release

    args = run_parser(f"{kind} evaluation of a frozen encoder", "linear_demo, linear_b16", resume=False).parse_args(argv)
    rank, world = world_from_env()
    try:
        cfg = config_from_args(args, ProbeConfig)
        encoder, spec, num_classes = _probe_setup(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device = init_distributed() if world > 1 else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        run_dir = open_run_dir(cfg, rank)  # held by this job: a second one on it stops here
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    encoder.to(device)
    d, pr = cfg.data, cfg.probe
    common = dict(img_size=encoder.patch_embed.img_size[0], batch_size=pr.batch_size, mean=d.mean, std=d.std,
                  pool=pr.pool, num_workers=d.num_workers, allow_pipe=d.allow_pipe, rank=rank, world_size=world)  # fmt: skip
    train_x, train_y = extract_features(encoder, spec["train"], **common)
    val_x, val_y = extract_features(encoder, spec["val"], **common)
    if rank != 0:
        return 0
    if kind == "knn":
        res = knn_classify(train_x, train_y, val_x, val_y, num_classes, pr.k, pr.temperature)
    else:
        res = linear_probe(train_x, train_y, val_x, val_y, num_classes, epochs=pr.epochs, batch_size=pr.batch_size,
                           blr=pr.blr, momentum=pr.momentum, weight_decay=pr.weight_decay,
                           warmup_epochs=pr.warmup_epochs, seed=cfg.seed)  # fmt: skip
    results = {**res, "eval": kind, "init": cfg.init, "num_train": len(train_y), "num_val": len(val_y), "ranks": world}
    (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    release(run_dir)
    print(json.dumps(results))
    return 0


def _probe_setup(cfg) -> tuple[VisionTransformer, dict[str, object], int]:
    """(the encoder from ``init``, the train/val shard specs, the class count); ConfigError names the key."""
    from mpp.build import build_encoder
    from mpp.config import ConfigError
    from mpp.data import digits_shards, expand_shards, read_sizes

    torch.manual_seed(cfg.seed)
    encoder = build_encoder(cfg)
    img = encoder.patch_embed.img_size[0]
    d = cfg.data
    spec = {"train": d.train_shards or digits_shards(img)["train"], "val": d.val_shards or digits_shards(img)["val"]}
    names = (read_sizes(expand_shards(spec["train"])) or {}).get("class_names") or []
    num_classes = d.num_classes or len(names)
    if not num_classes:
        raise ConfigError(f"{cfg._source}: data.num_classes: not set and the shards carry no class list")
    return encoder, spec, num_classes
