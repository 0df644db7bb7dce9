"""One call per job: ``run_pretrain(cfg)`` and ``run_finetune(cfg)`` take a loaded config to the
end of its run in this process (one process, or one rank under a launcher or in a submitit job)
and return it as a ``Finished``. What stops them is one of the library's named errors, with its
whole message: ``ConfigError`` (``RunHeld`` too) before the run directory exists, ``PortInUse``,
``Preempted``, ``NonFiniteLossError``, ``DataError``, ``DiskFullError``, ``CheckpointError``.
The CLIs, ``mpp.pretrain()``/``mpp.finetune()`` and the submitit job call them; exit statuses
exist only in the command layer (``mpp.commands.job``)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from mpp.build import build_objective, with_init_facts
from mpp.checkpoint.manager import encoder_kwargs
from mpp.checkpoint.state import seed_everything
from mpp.cli import open_run_dir
from mpp.config import Config, ConfigError, FinetuneConfig
from mpp.parallel.distributed import device_type, from_rank0, init_distributed, world_from_env
from mpp.train.hooks import Hook
from mpp.train.monitor import MonitorHook
from mpp.train.plan import (
    check_data,
    check_resume,
    finished_run,
    newest_checkpoint,
    plan_run,
    run_dir_of,
)
from mpp.train.preemption import StopHook
from mpp.train.preview import PreviewHook
from mpp.train.runlock import release
from mpp.train.summary import run_summary
from mpp.train.trainer import Trainer
from mpp.transfer.finetune import build_classifier, train_classifier

log = logging.getLogger(__name__)


@dataclass
class Finished:
    run_dir: Path
    # pretraining: the final RunState; fine-tuning: results.json's dict (rank 0); None when the
    # run had finished before (``ran`` False: said in one line, nothing ran or was written)
    result: Any
    seconds: float  # this invocation's, resumed runs' earlier parts not counted
    ran: bool = True
    own: Progress | None = None  # this invocation's steps and images, and the run's last step


class Progress(Hook):
    """What one invocation trained (a resumed run's earlier parts not counted): optimiser
    steps and images from where it started, and the run's step it ended at."""

    every = 0  # read from the run's state: nothing to do at a step

    def __init__(self) -> None:
        self.first_step = self.first_samples = 0
        self.state: Any = None

    def start(self, trainer: Any) -> None:
        self.state = trainer.state
        self.first_step, self.first_samples = self.state.step, self.state.samples

    @property
    def step(self) -> int:
        return self.state.step if self.state is not None else self.first_step

    @property
    def samples(self) -> int:
        return self.state.samples if self.state is not None else self.first_samples

    @property
    def steps(self) -> int:
        return self.step - self.first_step

    @property
    def images(self) -> int:
        return self.samples - self.first_samples


def start_of(
    cfg: Any, resume: str | None, restart: bool, rank: int, encoder: nn.Module | None = None
) -> str | None:
    """Where the run starts: ``resume`` as given ("auto" or a checkpoint); with ``restart`` from
    scratch; else from the run directory's newest complete checkpoint when it holds one
    (``going_on`` says so), so the same command run again goes on rather than starting over.
    ConfigError when the checkpoint is missing or cannot be resumed with this config and
    ``encoder`` (``check_resume``: another objective or model, precision, global batch)."""
    if resume and restart:
        raise ConfigError("resume and restart: choose one (restart moves the earlier run aside)")
    if resume not in (None, "auto") and not Path(resume).exists():
        raise ConfigError(f"--resume {resume}: no such checkpoint")
    if resume or restart or newest_checkpoint(cfg) is None:
        check_resume(cfg, resume, encoder)
        return resume
    check_resume(cfg, "auto", encoder)  # a refusal first, not "going on" and then a refusal
    return "auto"


def going_on(cfg: Any, given: str | None, resume: str | None, rank: int) -> None:
    """Rank 0: the line saying that the run goes on from its newest checkpoint unasked
    (``start_of`` chose it for ``given``, no --resume)."""
    if rank == 0 and given is None and resume == "auto":
        print(
            f"{run_dir_of(cfg)} holds a checkpoint ({newest_checkpoint(cfg)}): going on from it "
            "(--restart starts over, --output-dir names a new run)",
            file=sys.stderr,
        )


# what a finished run leaves that its user reads (fine-tuning: results.json; curves: `mpp plot`)
OUTPUTS = ("encoder.safetensors", "results.json", "metrics.jsonl", "curves.png")


def said_finished(cfg: Any, tag: str, step: int) -> str:
    """The line a run that had finished before answers with: its step and where its outputs are."""
    run_dir = run_dir_of(cfg)
    outputs = ", ".join(n for n in OUTPUTS if (run_dir / n).exists())
    return (
        f"finished before: {run_dir} is at step {step} ({tag}), the last this config trains, its "
        f"encoder exported; nothing ran or was rewritten -> {run_dir}: {outputs} (--restart "
        "starts over; a larger train.max_steps or train.epochs goes on)"
    )


def initial_model(cfg: Config | FinetuneConfig) -> nn.Module:
    """What the run trains, the same initial weights on every rank and every run (ConfigError):
    pretraining's objective, or fine-tuning's classifier around its initial encoder."""
    seed_everything(cfg.train.seed)
    return build_classifier(cfg) if isinstance(cfg, FinetuneConfig) else build_objective(cfg)


def run_pretrain(cfg: Config, resume: str | None = None, restart: bool = False) -> Finished:
    """Pretrain: the final encoder in ``RUN/encoder.safetensors``; ``result`` the last RunState."""
    objective = initial_model(cfg)

    def train(plan, run_dir, device, resume, progress):
        # data.mean / std "auto": measured with the plan (mpp.data.stats), known now
        objective.set_pixel_stats(plan.pixels.mean, plan.pixels.std)
        # the preview, then the monitor (the k-NN and the held-out loss), then a stop signal's
        # checkpoint
        hooks = [PreviewHook(cfg), MonitorHook(cfg, run_dir), StopHook(run_dir), progress]
        return Trainer(cfg, objective, plan, run_dir, device, resume=resume, hooks=hooks).train()

    return _run(cfg, objective, train, resume, restart)


def run_finetune(cfg: FinetuneConfig, resume: str | None = None, restart: bool = False) -> Finished:
    """Fine-tune for classification: ``result`` is what ``RUN/results.json`` holds (rank 0)."""
    model = initial_model(cfg)

    def train(plan, run_dir, device, resume, progress):
        # a classifier has no masks to preview, no monitor section
        hooks = [StopHook(run_dir), progress]
        return train_classifier(cfg, model, plan, run_dir, device, resume=resume, hooks=hooks)

    return _run(cfg, model, train, resume, restart, num_classes=model.num_classes)


def _run(
    cfg: Any,
    model: nn.Module,
    train: Callable[..., Any],
    resume: str | None,
    restart: bool,
    num_classes: int | None = None,
) -> Finished:
    """The steps every training job takes: every check that needs no process group first (the
    config, the resume, the data), then the process group, the plan (rank 0's, on every rank),
    and, unless the run had finished before (``finished_run``: said, nothing written), the run
    directory held by this job and ``train(plan, run_dir, device, resume, progress)`` (the
    ``Progress`` hook it registers); ``model``: the objective or the classifier."""
    rank, world = world_from_env()
    encoder = model.encoder
    img_size = encoder.patch_embed.img_size[0]
    given, resume = resume, start_of(cfg, resume, restart, rank, encoder)
    # the data as read: channels and statistics the config leaves unset taken from its init
    data_cfg = with_init_facts(cfg)
    check_data(data_cfg, img_size)
    device = init_distributed()
    # the shards' samples counted by the ranks together (mpp.data.census)
    plan = from_rank0(plan_run(data_cfg, world, device_type(), img_size, num_classes=num_classes))
    # nothing left to train: said, and the run directory left as it is
    if resume == "auto" and (end := from_rank0(finished_run(cfg, plan))):
        if rank == 0:
            print(said_finished(cfg, *end))
        return Finished(run_dir_of(cfg), None, 0.0, ran=False)
    going_on(cfg, given, resume, rank)
    if rank == 0:  # what it will do: parameters, batch, lr, schedule, data, the step's settings
        log.info("%s", run_summary(data_cfg, plan, model, device))
    # a second job on it stops here; its config.json as loaded, data.json what was measured,
    # model.json the encoder built
    run_dir = open_run_dir(
        cfg, rank, restart=restart, pixels=plan.pixels, model=encoder_kwargs(cfg, encoder)
    )
    start, progress = time.perf_counter(), Progress()
    try:
        result = train(plan, run_dir, device, resume, progress)
    finally:
        release(run_dir)
    return Finished(run_dir, result, time.perf_counter() - start, own=progress)
