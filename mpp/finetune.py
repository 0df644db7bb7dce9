"""Supervised fine-tuning (DESIGN.md §4.6, MAE/BEiT recipe): the classifier objective with
mixup / cutmix / label smoothing / random erasing on the device, layer-wise lr decay, loading
pretrained weights (position embedding resampled to the new grid), and evaluation.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from mpp.checkpoint import load_pretrained
from mpp.models.vit import VisionTransformer, resample_abs_pos_embed
from mpp.objectives.base import Objective


def soft_targets(labels: Tensor, num_classes: int, smoothing: float) -> Tensor:
    """One-hot (B, C) with label smoothing: 1 - s + s/C on the label, s/C elsewhere."""
    off = smoothing / num_classes
    return torch.full((labels.shape[0], num_classes), off, device=labels.device).scatter_(
        1, labels.unsqueeze(1), 1.0 - smoothing + off
    )


def mixup_cutmix(
    images: Tensor, targets: Tensor, mixup: float, cutmix: float, prob: float = 1.0, switch_prob: float = 0.5
) -> tuple[Tensor, Tensor, float]:
    """timm's batch-mode Mixup: with probability ``prob`` mix each image with the batch's
    flipped order, by a Beta(a, a) weight (mixup) or a box of that area (cutmix, weight
    corrected to the box actually cut). Returns (images, soft targets, lam)."""
    if (mixup <= 0 and cutmix <= 0) or torch.rand(()).item() >= prob:
        return images, targets, 1.0
    use_cutmix = cutmix > 0 and (mixup <= 0 or torch.rand(()).item() < switch_prob)
    alpha = cutmix if use_cutmix else mixup
    lam = float(torch.distributions.Beta(alpha, alpha).sample())
    flipped = images.flip(0)
    if use_cutmix:
        H, W = images.shape[-2:]
        cut_h, cut_w = int(H * math.sqrt(1 - lam)), int(W * math.sqrt(1 - lam))
        cy, cx = int(torch.randint(H, ())), int(torch.randint(W, ()))
        y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, H)
        x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, W)
        images = images.clone()
        images[..., y0:y1, x0:x1] = flipped[..., y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / (H * W)
    else:
        images = images * lam + flipped * (1.0 - lam)
    return images, targets * lam + targets.flip(0) * (1.0 - lam), lam


def random_erasing(images: Tensor, prob: float, area=(0.02, 1 / 3), aspect=(0.3, 1 / 0.3)) -> Tensor:
    """timm's RandomErasing (mode 'pixel'), batched: each image, with probability ``prob``,
    gets one box of N(0, 1) noise (in normalised space), area and aspect drawn per image."""
    if prob <= 0:
        return images
    B, _, H, W = images.shape
    dev = images.device
    erase = torch.rand(B, device=dev) < prob
    target = torch.empty(B, device=dev).uniform_(*area) * H * W
    aspect = torch.exp(torch.empty(B, device=dev).uniform_(math.log(aspect[0]), math.log(aspect[1])))
    h = torch.sqrt(target * aspect).round().clamp(1, H)
    w = torch.sqrt(target / aspect).round().clamp(1, W)
    top = (torch.rand(B, device=dev) * (H - h + 1)).floor()
    left = (torch.rand(B, device=dev) * (W - w + 1)).floor()
    ys = torch.arange(H, device=dev).view(1, H, 1)
    xs = torch.arange(W, device=dev).view(1, 1, W)
    box = (ys >= top.view(B, 1, 1)) & (ys < (top + h).view(B, 1, 1)) & (xs >= left.view(B, 1, 1)) & (xs < (left + w).view(B, 1, 1))
    box &= erase.view(B, 1, 1)
    return torch.where(box.unsqueeze(1), torch.randn_like(images), images)


class Classifier(Objective):
    """``forward(images, labels) -> (loss, metrics)``: soft-target cross-entropy under the
    fine-tuning augmentations (training), plain cross-entropy + top-1 (evaluation)."""

    needs_labels = True

    def __init__(
        self,
        encoder: VisionTransformer,
        label_smoothing: float = 0.1,
        mixup: float = 0.8,
        cutmix: float = 1.0,
        mixup_prob: float = 1.0,
        mixup_switch_prob: float = 0.5,
        reprob: float = 0.25,
    ) -> None:
        super().__init__()
        if encoder.num_classes < 1:
            raise ValueError("the classifier's encoder needs num_classes >= 1")
        self.encoder = encoder
        self.num_classes = encoder.num_classes
        self.label_smoothing, self.reprob = label_smoothing, reprob
        self.mixup, self.cutmix, self.mixup_prob, self.switch_prob = mixup, cutmix, mixup_prob, mixup_switch_prob

    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()}

    def forward(self, images: Tensor, labels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        if not self.training:
            logits = self.encoder(images)
            return F.cross_entropy(logits.float(), labels), {"acc": (logits.argmax(-1) == labels).float().mean()}
        targets = soft_targets(labels, self.num_classes, self.label_smoothing)
        images, targets, _ = mixup_cutmix(images, targets, self.mixup, self.cutmix, self.mixup_prob, self.switch_prob)
        images = random_erasing(images, self.reprob)
        logits = self.encoder(images).float()
        loss = torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()
        return loss, {"loss": loss.detach(), "acc": (logits.argmax(-1) == labels).float().mean().detach()}


def layer_id(name: str, depth: int) -> int:
    """BEiT/MAE layer ids: embeddings 0, block i -> i + 1, everything after the blocks depth + 1."""
    name = name.removeprefix("encoder.")
    if name.startswith(("cls_token", "pos_embed", "patch_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def layer_decay_scale(depth: int, decay: float):
    """lr_scale_of(name) = decay^(depth + 1 - layer_id): block i gets decay^(depth - i)."""
    return lambda name: decay ** (depth + 1 - layer_id(name, depth))


def load_into(model: VisionTransformer, init: str | Path) -> dict[str, list[str]]:
    """Load pretrained encoder weights into ``model``: the head is left fresh, the position
    embedding resampled to the model's grid; any other shape mismatch is an error naming it.
    Returns the keys left at their initialisation (e.g. head, fc_norm)."""
    sd, _ = load_pretrained(init)
    own = model.state_dict()
    if "pos_embed" in sd and sd["pos_embed"].shape != own["pos_embed"].shape:
        sd["pos_embed"] = resample_abs_pos_embed(sd["pos_embed"], model.grid_size, num_prefix_tokens=model.num_prefix_tokens)
    sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
    if model.global_pool == "avg":
        sd = {k: v for k, v in sd.items() if not k.startswith("norm.")}  # MAE: pooled features get a fresh fc_norm
    for k, v in sd.items():
        if k not in own:
            raise ValueError(f"init {init}: {k} is not a parameter of the model (a different architecture?)")
        if v.shape != own[k].shape:
            raise ValueError(f"init {init}: {k} has shape {tuple(v.shape)}, the model expects {tuple(own[k].shape)}")
    missing = [k for k in own if k not in sd]
    unexpected_missing = [k for k in missing if not k.startswith(("head.", "fc_norm.", "norm."))]
    if unexpected_missing:
        raise ValueError(f"init {init}: missing {len(unexpected_missing)} encoder weights, e.g. {unexpected_missing[:3]} (a different depth or size?)")
    model.load_state_dict(sd, strict=False)
    return {"initialised": missing}


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, mean, std, dtype=torch.float32) -> dict[str, float]:
    """Top-1 / top-5 / loss over an exact single pass, summed over ranks."""
    from mpp.data import normalize

    was_training = model.training
    model.eval()
    stats = torch.zeros(4, device=device, dtype=torch.float64)  # correct1, correct5, loss sum, count
    for batch in loader:
        images = normalize(batch["image"].to(device), mean, std).to(dtype)
        labels = batch["label"].to(device)
        logits = model.encoder(images).float()
        top5 = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
        stats[0] += (top5[:, 0] == labels).sum()
        stats[1] += (top5 == labels.unsqueeze(1)).any(1).sum()
        stats[2] += F.cross_entropy(logits, labels, reduction="sum")
        stats[3] += labels.numel()
    if dist.is_initialized():
        dist.all_reduce(stats)
    model.train(was_training)
    n = max(stats[3].item(), 1.0)
    return {"top1": 100.0 * stats[0].item() / n, "top5": 100.0 * stats[1].item() / n, "val_loss": stats[2].item() / n, "num_val": int(n)}


# ---- the fine-tuning run ---------------------------------------------------------------------


def resolve_classes(cfg, train_shards: list[str]) -> int:
    """The class count: the config's, checked against the shards' class list when they have one."""
    from mpp.config import ConfigError
    from mpp.data import read_sizes

    sizes = read_sizes(train_shards) or {}
    names = sizes.get("class_names") or []
    n = cfg.finetune.num_classes or cfg.data.num_classes or (len(names) or None)
    if n is None:
        raise ConfigError(f"{cfg._source}: finetune.num_classes: not set and the shards carry no class list")
    if names and n != len(names):
        raise ConfigError(f"{cfg._source}: finetune.num_classes: {n} does not match the {len(names)} classes of {train_shards[0]}")
    return n


def build_classifier(cfg) -> Classifier:
    """The encoder with a fresh head, initialised from ``cfg.init`` (or from scratch)."""
    from mpp.build import build_encoder
    from mpp.data import digits_shards, expand_shards

    spec = cfg.data.train_shards or digits_shards(_vit_kwargs(cfg)["img_size"])["train"]
    num_classes = resolve_classes(cfg, expand_shards(spec))
    encoder = build_encoder(cfg, num_classes=num_classes, global_pool=cfg.finetune.global_pool)
    f = cfg.finetune
    return Classifier(encoder, f.label_smoothing, f.mixup, f.cutmix, f.mixup_prob, f.mixup_switch_prob, f.reprob)


def _vit_kwargs(cfg) -> dict:
    """The full constructor arguments of the configured variant (for metadata and the data size)."""
    from mpp.models.vit import vit_config

    return {**vit_config(cfg.model.name), **cfg.model.vit_kwargs()}


def run_finetune(cfg, model: Classifier, plan, run_dir: Path, device: torch.device, resume: str | None = None) -> dict:
    """Fine-tune under DeepSpeed, evaluate every epoch, keep the best and last weights,
    write results.json (top1, top5, epoch, init). Returns the results on rank 0."""
    import json

    from mpp import checkpoint as ckpt
    from mpp.data import digits_shards, make_eval_loader
    from mpp.engine import train

    val_spec = cfg.data.val_shards or digits_shards(plan.img_size)["val"]
    eval_bs = cfg.finetune.eval_batch_size or plan.micro_batch
    rank, world = dist.get_rank(), dist.get_world_size()
    best: dict = {"top1": -1.0}
    results_path = run_dir / "results.json"
    if resume and results_path.is_file():
        best = json.loads(results_path.read_text()).get("best", best)

    def on_epoch_end(engine, state) -> dict:
        nonlocal best
        dtype = next(engine.module.parameters()).dtype
        loader = make_eval_loader(val_spec, batch_size=eval_bs, img_size=plan.img_size, rank=rank, world_size=world,
                                  num_workers=min(cfg.data.num_workers, 1), allow_pipe=cfg.data.allow_pipe)
        res = {**evaluate(engine.module, loader, device, cfg.data.mean, cfg.data.std, dtype),
               "epoch": round(state.step / plan.steps_per_epoch, 3)}
        weights = ckpt.gathered_state_dict(engine)
        if rank == 0:
            meta = {"model": {**_vit_kwargs(cfg), "num_classes": engine.module.num_classes,
                              "global_pool": cfg.finetune.global_pool}}
            enc = {k.removeprefix("encoder."): v for k, v in weights.items()}
            ckpt.save_weights(enc, run_dir / "model_last.safetensors", meta)
            if res["top1"] > best["top1"]:
                best = res
                ckpt.save_weights(enc, run_dir / "model_best.safetensors", meta)
            out = {"top1": best["top1"], "top5": best["top5"], "epoch": best["epoch"], "init": cfg.init,
                   "last": res, "best": best}
            results_path.write_text(json.dumps(out, indent=2) + "\n")
            print(f"epoch {res['epoch']:.2f}: top1 {res['top1']:.2f}  top5 {res['top5']:.2f}  (best {best['top1']:.2f})")
        return {f"val_{k}" if not k.startswith("val_") else k: v for k, v in res.items()}

    f = cfg.finetune
    train(
        cfg, model, plan, run_dir, device, resume=resume,
        model_kwargs={"name": cfg.model.name, **cfg.model.vit_kwargs(), "num_classes": model.num_classes, "global_pool": f.global_pool},
        lr_scale_of=layer_decay_scale(len(model.encoder.blocks), cfg.optim.layer_decay),
        loader_kwargs={"randaug": (f.randaug_n, f.randaug_m) if f.randaug_n > 0 else None},
        on_epoch_end=on_epoch_end, desc="finetune",
    )  # fmt: skip
    return json.loads(results_path.read_text()) if rank == 0 else {}
