"""One call per job: ``run_pretrain(cfg)`` and ``run_finetune(cfg)`` take a loaded config to the
end of its run in this process (one process, or one rank under a launcher or in a submitit job)
and return it as a ``Finished``. What stops them is one of the library's named errors, with its
whole message: ``ConfigError`` (``RunHeld`` too) before the run directory exists, ``PortInUse``,
``Preempted``, ``NonFiniteLossError``, ``DataError``, ``DiskFullError``, ``CheckpointError``.
The CLIs, ``mpp.pretrain()``/``mpp.finetune()`` and the submitit job call them; exit statuses
exist only in the command layer (``mpp.commands.job``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from mpp.build import build_objective
from mpp.checkpoint.manager import encoder_kwargs
from mpp.checkpoint.state import seed_everything
from mpp.cli import open_run_dir
from mpp.config import Config, ConfigError, FinetuneConfig
from mpp.parallel.distributed import device_type, from_rank0, init_distributed, world_from_env
from mpp.train.monitor import MonitorHook
from mpp.train.plan import check_data, check_resume, newest_checkpoint, plan_run, run_dir_of
from mpp.train.preemption import StopHook
from mpp.train.preview import PreviewHook
from mpp.train.runlock import release
from mpp.train.trainer import Trainer
from mpp.transfer.finetune import build_classifier, train_classifier


@dataclass
class Finished:
    run_dir: Path
    result: Any  # pretraining: the final RunState; fine-tuning: results.json's dict (rank 0)
    seconds: float  # this invocation's, resumed runs' earlier parts not counted


def start_of(cfg: Any, resume: str | None, restart: bool, rank: int) -> str | None:
    """Where the run starts: ``resume`` as given ("auto" or a checkpoint); with ``restart`` from
    scratch; else from the run directory's newest complete checkpoint when it holds one (said in
    one line), so the same command run again goes on rather than starting over. ConfigError
    when the checkpoint is missing or cannot be resumed with this config (``check_resume``)."""
    if resume and restart:
        raise ConfigError("resume and restart: choose one (restart moves the earlier run aside)")
    if resume not in (None, "auto") and not Path(resume).exists():
        raise ConfigError(f"--resume {resume}: no such checkpoint")
    if resume or restart or (tag := newest_checkpoint(cfg)) is None:
        check_resume(cfg, resume)
        return resume
    check_resume(cfg, "auto")  # a refusal first, not "going on" and then a refusal
    if rank == 0:
        print(
            f"{run_dir_of(cfg)} holds a checkpoint ({tag}): going on from it (--restart starts "
            "over, --output-dir names a new run)",
            file=sys.stderr,
        )
    return "auto"


def initial_model(cfg: Config | FinetuneConfig) -> nn.Module:
    """What the run trains, the same initial weights on every rank and every run (ConfigError):
    pretraining's objective, or fine-tuning's classifier around its initial encoder."""
    seed_everything(cfg.train.seed)
    return build_classifier(cfg) if isinstance(cfg, FinetuneConfig) else build_objective(cfg)


def run_pretrain(cfg: Config, resume: str | None = None, restart: bool = False) -> Finished:
    """Pretrain: the final encoder in ``RUN/encoder.safetensors``; ``result`` the last RunState."""
    objective = initial_model(cfg)

    def train(plan, run_dir, device, resume):
        # data.mean / std "auto": measured with the plan (mpp.data.stats), known now
        objective.set_pixel_stats(plan.pixels.mean, plan.pixels.std)
        # the preview, then the monitor (the k-NN and the held-out loss), then a stop signal's
        # checkpoint
        hooks = [PreviewHook(cfg), MonitorHook(cfg, run_dir), StopHook(run_dir)]
        return Trainer(cfg, objective, plan, run_dir, device, resume=resume, hooks=hooks).train()

    return _run(cfg, objective.encoder, train, resume, restart)


def run_finetune(cfg: FinetuneConfig, resume: str | None = None, restart: bool = False) -> Finished:
    """Fine-tune for classification: ``result`` is what ``RUN/results.json`` holds (rank 0)."""
    model = initial_model(cfg)

    def train(plan, run_dir, device, resume):
        hooks = [StopHook(run_dir)]  # a classifier has no masks to preview, no monitor section
        return train_classifier(cfg, model, plan, run_dir, device, resume=resume, hooks=hooks)

    return _run(cfg, model.encoder, train, resume, restart, num_classes=model.num_classes)


def _run(
    cfg: Any,
    encoder: nn.Module,
    train: Callable[..., Any],
    resume: str | None,
    restart: bool,
    num_classes: int | None = None,
) -> Finished:
    """The steps every training job takes: every check that needs no process group first (the
    config, the resume, the data), then the process group, the plan (rank 0's, on every rank),
    the run directory held by this job, and ``train(plan, run_dir, device, resume)``."""
    rank, world = world_from_env()
    img_size = encoder.patch_embed.img_size[0]
    resume = start_of(cfg, resume, restart, rank)
    check_data(cfg, img_size)
    device = init_distributed()
    # the shards' samples counted by the ranks together (mpp.data.census)
    plan = from_rank0(plan_run(cfg, world, device_type(), img_size, num_classes=num_classes))
    # a second job on it stops here; its config.json as loaded, data.json what was measured,
    # model.json the encoder built
    run_dir = open_run_dir(
        cfg, rank, restart=restart, pixels=plan.pixels, model=encoder_kwargs(cfg, encoder)
    )
    start = time.perf_counter()
    try:
        result = train(plan, run_dir, device, resume)
    finally:
        release(run_dir)
    return Finished(run_dir, result, time.perf_counter() - start)
