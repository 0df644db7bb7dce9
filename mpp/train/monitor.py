"""Is the encoder getting better? The loss can fall while the representation gets worse, so every
``train.monitor_every`` optimiser steps (before the first and after the last) pretraining measures, on held-out
images (solo-learn's online k-NN; DINOv2's advice to tune by k-NN, not by the loss):

- the weighted k-NN top-1 / top-5 of the current encoder, exactly ``downstream/knn.py``'s
  (``mpp.features``: centre crops, the last block's ``monitor.pool`` feature, k and temperature):
  its bank is ``monitor.bank_per_class`` labelled samples per class of the training shards
  (``mpp.data.labels``, seeded by ``monitor.seed``; keys in ``RUN/monitor_bank_keys.txt``), scored
  on the whole of ``monitor.val_shards`` (default ``data.val_shards``, else the built-in dataset's
  validation split). ``knn.py --set init=RUN --set data.label_keys=RUN/monitor_bank_keys.txt``
  gives the same number for the run's final encoder;
- the objective's own held-out signal (``Objective.held_out_metrics``: MPP's masked-patch
  accuracy, MAE's reconstruction loss, HPM's predictor rank correlation), its masks from a fixed
  seed in a forked RNG, so training draws what it would without the monitor.

Into metrics.jsonl, TensorBoard and W&B as ``monitor/<name>``. The images are decoded once, each
rank its share (uint8, host memory); every rank runs the same number of forwards (under ZeRO-3
each is a collective; the parameters are gathered as the previews' are).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mpp.data import make_eval_loader
from mpp.features import gather_in_key_order, knn_classify, pooled_features
from mpp.ops import normalize
from mpp.parallel import zero
from mpp.parallel.distributed import in_step
from mpp.train.hooks import Hook

log = logging.getLogger(__name__)
BANK_KEYS = "monitor_bank_keys.txt"  # in the run directory
SEED = 4321  # the held-out masks' seed: the same masks at every monitor
CHUNK = 256  # images per forward


@dataclass
class Images:
    """This rank's share of a fixed image set, decoded once: uint8 (n, C, S, S), labels, keys."""

    images: Tensor
    labels: Tensor | None
    keys: list[str]


def load_images(shards: Any, img_size: int, settings: dict) -> Images:
    """This rank's share of ``shards`` (``make_eval_loader``'s split by rank, ``settings``: its
    keyword arguments), centre-cropped as knn.py crops them."""
    loader = make_eval_loader(shards, batch_size=CHUNK, img_size=img_size, **settings)
    images, labels, keys = [], [], []
    for batch in loader:
        images.append(batch["image"])
        labels.append(batch.get("label"))
        keys += batch["key"]
    if not images:  # this rank's share is empty: the others may not be
        chans = settings["pixels"].channels
        labels = torch.empty(0, dtype=torch.int64) if settings.get("with_labels", True) else None
        return Images(torch.empty(0, chans, img_size, img_size, dtype=torch.uint8), labels, [])
    with_labels = labels[0] is not None
    return Images(torch.cat(images), torch.cat(labels) if with_labels else None, keys)


@dataclass
class Monitor:
    """``monitor(objective, step, last) -> values or None``, after each optimiser step on every
    rank; the values are rank 0's to log."""

    every: int
    bank: Images | None
    val: Images | None
    settings: Any
    mean: tuple[float, ...]
    std: tuple[float, ...]
    device: torch.device

    def __post_init__(self) -> None:
        distributed = dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world = dist.get_world_size() if distributed else 1

    @torch.no_grad()
    def __call__(self, objective: Any, step: int, last: bool = False) -> dict[str, float] | None:
        if not self.every or self.val is None or not (last or step % self.every == 0):
            return None
        started = time.perf_counter()
        params = list(objective.parameters())  # HPM's teacher too: it scores the held-out images
        devices = [self.device] if self.device.type == "cuda" else []
        was_training = objective.training
        objective.eval()
        try:
            with zero.gathered(params), torch.random.fork_rng(devices=devices):
                values = self.knn(objective.encoder) | self.signals(objective)
        finally:
            objective.train(was_training)
        values["seconds"] = time.perf_counter() - started  # its cost (BENCHMARKS.md "monitor")
        return {f"monitor/{k}": v for k, v in values.items()} if self.rank == 0 else None

    def forward_chunks(self, images: Images, fn) -> list[Any]:
        """``fn(normalised chunk)`` for each chunk of this rank's images; while another rank has
        chunks left, one dummy image's (every rank the same number of forwards), giving None."""
        out = []
        mine = [c for c in images.images.split(CHUNK) if len(c)]
        for chunk in in_step(mine, self.device):
            dummy = chunk is None
            if dummy:
                chunk = torch.zeros(1, *images.images.shape[1:], dtype=torch.uint8)
            result = fn(normalize(chunk.to(self.device), self.mean, self.std))
            out.append(None if dummy else result)
        return out

    def features(self, encoder: Any, images: Images) -> tuple[Tensor, Tensor, list[str]]:
        """Every rank's features (n, D), labels and keys, gathered on every rank in key order."""
        slot = [(len(encoder.blocks) - 1, self.settings.pool)]
        parts = self.forward_chunks(images, lambda x: pooled_features(encoder, x, slot)[:, 0])
        feats = [p.cpu() for p in parts if p is not None]
        dim = encoder.embed_dim
        mine = torch.cat(feats) if feats else torch.empty(0, dim)
        return gather_in_key_order(mine, images.labels, images.keys, self.world)

    def knn(self, encoder: Any) -> dict[str, float]:
        """knn.py's weighted k-NN of the encoder: the bank against the held-out images (every
        rank takes part, whatever its share; a bank only where both sides have labels)."""
        if self.bank is None:
            return {}
        train_x, train_y, _ = self.features(encoder, self.bank)
        val_x, val_y, _ = self.features(encoder, self.val)
        if self.rank != 0 or not len(train_y) or not len(val_y):
            return {}
        num_classes = int(max(train_y.max(), val_y.max())) + 1
        s = self.settings
        res = knn_classify(train_x, train_y, val_x, val_y, num_classes, s.k, s.temperature)
        return {"knn_top1": res["top1"], "knn_top5": res["top5"]}

    def signals(self, objective: Any) -> dict[str, float]:
        """The objective's held-out metrics, averaged over every held-out image of every rank."""
        torch.manual_seed(SEED + self.rank)
        parts = [p for p in self.forward_chunks(self.val, objective.held_out_metrics) if p]
        names = sorted(parts[0]) if parts else []
        if self.world > 1:  # the metric names: a rank without held-out images has none of its own
            every: list = [None] * self.world
            dist.all_gather_object(every, names)
            names = next((n for n in every if n), [])
        if not names:
            return {}
        sums = torch.zeros(len(names) + 1, dtype=torch.float64, device=self.device)
        for p in parts:
            sums[:-1] += torch.stack([p[n].double().sum() for n in names])
            sums[-1] += len(p[names[0]])
        if self.world > 1:
            dist.all_reduce(sums)
        return {n: (sums[i] / sums[-1].clamp(min=1)).item() for i, n in enumerate(names)}


def build_monitor(
    cfg: Any, plan: Any, objective: Any, device: torch.device, run_dir: Path
) -> Monitor:
    """The run's monitor (a collective: every rank builds it); one that never measures when
    ``train.monitor_every`` is 0, the config has no monitor section (fine-tuning) or there are
    no held-out images. Without labels on both sides the k-NN is left out, with a warning."""
    from mpp.train.plan import monitor_on, shards

    every = cfg.train.monitor_every
    settings = getattr(cfg, "monitor", None)
    d = cfg.data
    px = plan.pixels
    off = Monitor(0, None, None, settings, px.mean, px.std, device)
    if not monitor_on(cfg) or not hasattr(objective, "held_out_metrics"):
        return off
    from mpp.data.labels import choose, label_index, shard_labels

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    val_shards = shards(cfg, "monitor", plan.img_size, look=False)  # looked for by check_data
    if val_shards is None:
        if rank == 0:
            log.warning("monitor: no held-out images (set monitor.val_shards or data.val_shards)")
        return off
    load = dict(rank=rank, world_size=world, num_workers=d.num_workers, with_keys=True)
    load.update(allow_pipe=d.allow_pipe, pixels=px.format)
    index = label_index(plan.train_shards, d.allow_pipe)
    labelled_val = bool(shard_labels(val_shards[0], d.allow_pipe))
    bank, what = None, "no k-NN: the training or the held-out shards carry no labels (.cls)"
    if index.total and labelled_val:
        subset, _ = choose(
            index, settings.bank_per_class, seed=settings.seed, key="monitor.bank_per_class"
        )
        if rank == 0:
            subset.write(run_dir / BANK_KEYS)
        bank = load_images(subset.shards, plan.img_size, {**load, "shard_keys": subset.keys})
        what = f"the k-NN of a bank of {subset.summary()}"
    val = load_images(val_shards, plan.img_size, {**load, "with_labels": bank is not None})
    if rank == 0:
        log.info("monitor every %d steps on %s...: %s", every, val_shards[0], what)
    return Monitor(every, bank, val, settings, px.mean, px.std, device)


class MonitorHook(Hook):
    """The monitor as a ``mpp.train.hooks.Hook``: built when the loop starts (a collective),
    the encoder as initialised measured first, then every ``train.monitor_every`` steps and at
    the last one; the values to metrics.jsonl (and the reporters) as a ``monitor`` record."""

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        self.cfg, self.run_dir, self.monitor = cfg, run_dir, None
        self.every = cfg.train.monitor_every

    def start(self, trainer: Any) -> None:
        self.monitor = build_monitor(
            self.cfg, trainer.plan, trainer.objective, trainer.device, self.run_dir
        )
        if trainer.state.step == 0:  # the baseline: the encoder as initialised
            self._measure(trainer, 0)

    def step_end(self, trainer: Any) -> None:
        self._measure(trainer, trainer.state.step, trainer.state.step == trainer.stop)

    def _measure(self, trainer: Any, step: int, last: bool = False) -> None:
        with trainer.autocast():
            values = self.monitor(trainer.objective, step, last)
        trainer.metrics.write(trainer.state, trainer.plan, values, section="monitor")
