"""The fine-tuning run (docs/ARCHITECTURE.md §4.6, MAE/BEiT recipe): the class count from the shards, the
classifier around a pretrained encoder, and the engine's loop with an evaluation every epoch.
The pieces live in their own files: ``mpp.objectives.classifier`` (loss), ``mpp.data.augment``
(mixup / cutmix / erasing), ``mpp.train.optim`` (layer decay), ``mpp.hub.pretrained`` (weights in),
``mpp.transfer.evaluate`` (top-1, best / last weights, results.json)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mpp.build import build_encoder, encoder_args
from mpp.checkpoint.manager import encoder_kwargs
from mpp.config import ConfigError, FinetuneConfig
from mpp.data import read_sizes
from mpp.data.labels import KEY_FILE
from mpp.models.vit import full_vit_config, vit_config
from mpp.objectives.classifier import Classifier
from mpp.train.plan import Plan, shards
from mpp.train.trainer import Trainer
from mpp.transfer.evaluate import Evaluator


def resolve_classes(cfg: FinetuneConfig, train_shards: list[str]) -> int:
    """The class count: the config's, checked against the shards' class list when they have one."""
    sizes = read_sizes(train_shards) or {}
    names = sizes.get("class_names") or []
    n = cfg.finetune.num_classes or cfg.data.num_classes or (len(names) or None)
    if n is None:
        raise ConfigError(
            f"{cfg._source}: finetune.num_classes: not set and the shards carry no class list"
        )
    if names and n != len(names):
        raise ConfigError(
            f"{cfg._source}: finetune.num_classes: {n} does not match the {len(names)} classes of {train_shards[0]}"
        )
    return n


def build_classifier(cfg: FinetuneConfig) -> Classifier:
    """The encoder with a fresh head, initialised from ``cfg.init`` (or from scratch)."""
    # the encoder's side: init's where the config leaves it unset
    img_size = full_vit_config(encoder_args(cfg, quiet=True))["img_size"]
    # the count given: the shards are not looked for here (a submission's may be visible on the
    # compute nodes only; a run's are checked with its plan), only their class list read; else
    # read from the shards there (none: refused naming them)
    given = bool(cfg.finetune.num_classes or cfg.data.num_classes)
    num_classes = resolve_classes(cfg, shards(cfg, "train", img_size, look=not given))
    encoder = build_encoder(cfg, num_classes=num_classes, global_pool=cfg.finetune.global_pool)
    f = cfg.finetune
    return Classifier(
        encoder,
        f.label_smoothing,
        f.mixup,
        f.cutmix,
        f.mixup_prob,
        f.mixup_switch_prob,
        f.reprob,
        f.head_init_std,
    )


def train_classifier(
    cfg: FinetuneConfig,
    model: Classifier,
    plan: Plan,
    run_dir: Path,
    device: torch.device,
    resume: str | None = None,
    hooks: Sequence[Any] = (),
) -> dict:
    """Fine-tune under DeepSpeed, evaluated every epoch (or ``finetune.eval_every`` steps) by
    ``Evaluator`` (the last and best weights, results.json); with few labels, also write
    ``label_keys.txt``. Returns the results on rank 0."""
    model_kwargs = {**vit_config(cfg.model.name), **encoder_kwargs(cfg, model.encoder)}
    if plan.subset is not None and dist.get_rank() == 0:  # few labels: which ones, for reuse
        plan.subset.write(run_dir / KEY_FILE)
    evaluator = Evaluator(cfg, plan, run_dir, device, model_kwargs, resume)
    Trainer(
        cfg,
        model,
        plan,
        run_dir,
        device,
        resume=resume,
        evaluate=evaluator,
        evaluate_every=cfg.finetune.eval_every,
        hooks=hooks,
    ).train()
    return json.loads(evaluator.results_path.read_text()) if dist.get_rank() == 0 else {}
