"""Evaluation during fine-tuning: top-1 / top-5 / loss over one exact pass of the val shards,
and the per-epoch bookkeeping around it (best and last weights, results.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpp.checkpoint import format as ckpt
from mpp.checkpoint.state import RunState
from mpp.data import make_eval_loader
from mpp.hub.encoder_file import save_weights
from mpp.hub.pretrained import init_record
from mpp.ops import normalize
from mpp.parallel.distributed import in_step
from mpp.train.plan import Plan, shards


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, mean, std) -> dict[str, float]:
    """Top-1 / top-5 / loss over an exact single pass, summed over ranks."""
    was_training = model.training
    model.eval()
    # correct1, correct5, loss sum, count
    stats = torch.zeros(4, device=device, dtype=torch.float64)
    for batch in in_step(loader, device):
        if batch is None:  # this rank's shards are done, another rank's are not: a forward to match
            pe = model.encoder.patch_embed
            model.encoder(torch.zeros(1, pe.in_chans, *pe.img_size, device=device))
            continue
        images = normalize(batch["image"].to(device, non_blocking=True), mean, std)
        labels = batch["label"].to(device, non_blocking=True)
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
    return {
        "top1": 100.0 * stats[0].item() / n,
        "top5": 100.0 * stats[1].item() / n,
        "val_loss": stats[2].item() / n,
        "num_val": int(n),
    }


class Evaluator:
    """The trainer's ``evaluate`` hook: evaluate, write ``model_last`` / ``model_best``
    (.safetensors, fp32, with the architecture) and ``results.json``, print a line. Every rank
    calls it (the evaluation and the ZeRO-3 gather are collectives).

    ``results.json``'s ``top1`` / ``top5`` / ``epoch`` are the last evaluation's: the best epoch
    picked on the validation set overstates what a recipe reaches (more with few labels, where
    epochs are noisy), so it is only an extra, ``max_top1`` (MAE's "max accuracy"), with its
    weights in ``model_best``."""

    def __init__(
        self,
        cfg: Any,
        plan: Plan,
        run_dir: Path,
        device: torch.device,
        model_kwargs: dict,
        resume: str | None = None,
    ) -> None:
        self.cfg, self.plan, self.run_dir, self.device, self.model_kwargs = (
            cfg,
            plan,
            run_dir,
            device,
            model_kwargs,
        )
        self.init_read = init_record(cfg.init)  # what it started from, for results.json
        self.val_shards = shards(cfg, "val", plan.img_size, look=False)  # the plan looked
        self.batch_size = cfg.finetune.eval_batch_size or plan.micro_batch
        self.results_path = run_dir / "results.json"
        self.best: dict = {"top1": -1.0}
        if resume and self.results_path.is_file():
            self.best = json.loads(self.results_path.read_text()).get("best", self.best)

    def __call__(self, engine: Any, state: RunState) -> dict:
        d = self.cfg.data
        rank, world = dist.get_rank(), dist.get_world_size()
        loader = make_eval_loader(
            self.val_shards,
            batch_size=self.batch_size,
            img_size=self.plan.img_size,
            rank=rank,
            world_size=world,
            num_workers=d.num_workers,
            allow_pipe=d.allow_pipe,
            num_classes=engine.module.num_classes,
            pixels=self.plan.pixels.format,
        )
        res = {
            **evaluate(
                engine.module, loader, self.device, self.plan.pixels.mean, self.plan.pixels.std
            ),
            "epoch": round(state.step / self.plan.steps_per_epoch, 3),
        }
        weights = ckpt.gathered_state_dict(engine)
        if rank == 0:
            self.write(weights, res)
        return {f"val_{k}" if not k.startswith("val_") else k: v for k, v in res.items()}

    def write(self, weights: dict[str, torch.Tensor], res: dict) -> None:
        from tqdm import tqdm

        meta = {"model": self.model_kwargs}
        enc = {k.removeprefix("encoder."): v for k, v in weights.items()}
        save_weights(enc, self.run_dir / "model_last.safetensors", meta)
        if res["top1"] > self.best["top1"]:
            self.best = res
            save_weights(enc, self.run_dir / "model_best.safetensors", meta)
        best = self.best
        out = {
            "top1": res["top1"],
            "top5": res["top5"],
            "epoch": res["epoch"],
            "init": self.cfg.init,
            **self.init_read,
            "max_top1": best["top1"],
            "num_train": self.plan.samples_per_epoch,
            "last": res,
            "best": best,
        }
        self.results_path.write_text(json.dumps(out, indent=2) + "\n")
        # through the progress bar's writer: a plain print lands glued to the bar's line
        tqdm.write(
            f"epoch {res['epoch']:.2f}: top-1 {res['top1']:.2f} %, top-5 {res['top5']:.2f} % "
            f"(best top-1 {best['top1']:.2f} %)"
        )
