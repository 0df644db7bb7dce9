"""The training log: metrics.jsonl and TensorBoard on rank 0, averaged over ranks at log steps only,
so the step itself never waits for the host (docs/ARCHITECTURE.md §3.6, §6.3)."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from mpp.checkpoint.state import RunState
from mpp.train.plan import Plan

log = logging.getLogger(__name__)


def read_records(run_dir: Path, kind: str = "train") -> list[dict]:
    """``RUN/metrics.jsonl``'s records of one kind: ``"train"`` (a logging interval's loss, lr and
    img/s), ``"monitor"`` (the monitor's ``monitor/...`` values) or ``"all"``. A missing file is no
    records; a last line cut short by a kill is dropped."""
    path = Path(run_dir) / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if kind == "train":
        return [r for r in records if "imgs_per_sec" in r]
    if kind == "monitor":
        return [r for r in records if any(k.startswith("monitor/") for k in r)]
    return records


def last_figures(run_dir: Path) -> str:
    """The run's last loss and the monitor's last k-NN, for the line a run ends with."""
    records = read_records(run_dir, kind="all")
    parts = []
    if loss := [r["loss"] for r in records if "loss" in r and "imgs_per_sec" in r]:
        parts.append(f"last loss {loss[-1]:.4g}")
    if knn := [r for r in records if "monitor/knn_top1" in r]:
        # the first too: at step 0 it is the random encoder's, what pretraining has to beat
        ends = [knn[0], knn[-1]] if len(knn) > 1 else knn
        said = " -> ".join(f"{r['monitor/knn_top1']:.1f} % at step {r['step']}" for r in ends)
        parts.append(f"monitor k-NN top-1 {said}")
    if val := [r for r in records if "val_top1" in r]:
        parts.append(f"val top-1 {val[-1]['val_top1']:.2f} %")
    return ", ".join(parts)


def drop_records_after(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) without the records past ``step``, and without a last line
    cut short by a kill."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


class TensorBoard:
    """Scalars into ``RUN/tb`` (the default reporter)."""

    def __init__(self, run_dir: Path, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"))

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def image(self, tag: str, image: torch.Tensor, step: int, caption: str | None = None) -> None:
        """A (3, H, W) uint8 picture at ``step``; the caption once, as the tag's text."""
        self.writer.add_image(tag, image, step)
        if caption:
            self.writer.add_text(tag, caption, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    """Weights & Biases, optional (``pip install wandb``): the resolved config, and every
    metrics.jsonl field at its step. ``WANDB_MODE=offline`` writes the run under ``RUN/wandb``
    without a network; a resumed run continues the same W&B run (its id is kept in the run dir)."""

    def __init__(self, run_dir: Path, config: dict) -> None:
        import wandb

        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "mpp"),
            name=config.get("name"),
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
        )
        # our step as the x-axis, not W&B's own counter: W&B drops records whose step goes back,
        # and a resume from an older checkpoint or a rollback does go back
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, "step": step})

    def image(self, tag: str, image: torch.Tensor, step: int, caption: str | None = None) -> None:
        import wandb

        self.run.log(
            {tag: wandb.Image(image.permute(1, 2, 0).numpy(), caption=caption), "step": step}
        )

    def close(self) -> None:
        self.run.finish()


REPORTERS = {"tensorboard": TensorBoard, "wandb": WandB}


def open_reporters(names: list[str], run_dir: Path, config: dict) -> list:
    """The reporters ``train.report_to`` names; one whose package is missing is skipped with a warning."""
    reporters = []
    for name in names:
        try:
            reporters.append(REPORTERS[name](run_dir, config))
        except ImportError:
            log.warning("%s is not installed: train.report_to=%r reports nothing there", name, name)
    return reporters


class MetricLog:
    """metrics.jsonl and the reporters (TensorBoard, W&B) on rank 0; sums metrics on the device
    between log steps so the step itself never waits for the host."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        state: RunState,
        report_to: list[str] = ("tensorboard",),
        config: dict | None = None,
    ) -> None:
        """Continues at ``state``: after a resume, records past its step (written before the run
        stopped, and about to be replayed) are dropped, so each step is in the file once, and
        the next record says where the resume started (``resumed_at``: curves mark it)."""
        self.rank = rank
        self.restart(state)
        self.resumed_at = state.step or None
        self.file = None
        self.reporters: list = []
        self.path = run_dir / "metrics.jsonl"
        if rank == 0:
            if self.path.is_file():
                drop_records_after(self.path, state.step)
            self.file = open(self.path, "a")
            self.reporters = open_reporters(list(report_to), run_dir, config or {})

    def rewind(self, state: RunState) -> None:
        """The run went back to ``state`` (a rollback): records past its step go, sums restart."""
        self.restart(state)
        if self.rank == 0:
            self.file.close()
            drop_records_after(self.path, state.step)
            self.file = open(self.path, "a")

    def restart(self, state: RunState) -> None:
        """Empty sums; throughput and data wait measured from now, from ``state``'s samples."""
        self.sums: dict[str, torch.Tensor] = {}
        self.count, self.data_wait = 0, 0.0
        self.t0, self.samples0 = time.perf_counter(), state.samples
        # each optimiser step's mean loss and its lr since the last record: the curves draw
        # every step at any log_every (the losses stay on the device until the record)
        self.step_losses: list[torch.Tensor] = []
        self.step_lrs: list[float] = []
        self.step_sum, self.step_micro = None, 0

    def add(self, metrics: dict[str, torch.Tensor], data_wait: float) -> None:
        for k, v in metrics.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v.clone()
        loss = metrics["loss"].detach().float()
        self.step_sum = loss.clone() if self.step_sum is None else self.step_sum + loss
        self.count += 1
        self.step_micro += 1
        self.data_wait += data_wait

    def step_done(self, lr: float) -> None:
        """An optimiser step taken at ``lr``: its micro-batches' mean loss kept for the record."""
        if self.step_sum is not None:
            self.step_losses.append(self.step_sum / self.step_micro)
            self.step_lrs.append(lr)
        self.step_sum, self.step_micro = None, 0

    def flush(
        self, state: RunState, plan: Plan, lr: float, skipped: int
    ) -> dict[str, float] | None:
        """All-reduce the averages (every rank calls this), write one record on rank 0.
        ``skipped``: the bad samples this rank skipped since the last record; all ranks' are
        added to ``state.skipped``, the run's count that checkpoints carry, and recorded. An
        interval of several optimiser steps also records each one's loss and lr (``step_losses``,
        ``step_lrs``, the last at ``step``)."""
        keys = sorted(self.sums)
        dev = self.sums[keys[0]].device
        extra = torch.tensor([float(skipped), self.data_wait], device=dev)
        parts = [torch.stack([self.sums[k] / self.count for k in keys]), extra]
        if len(self.step_losses) > 1:  # same on every rank: they step together
            parts.append(torch.stack(self.step_losses))
        stats = torch.cat(parts)
        dist.all_reduce(stats)
        values = stats.tolist()
        world = dist.get_world_size()
        step_losses = [v / world for v in values[len(keys) + 2 :]]
        skipped_all, data_wait = values[len(keys) : len(keys) + 2]
        state.skipped += round(skipped_all)
        elapsed = time.perf_counter() - self.t0
        record = {
            "step": state.step,
            "epoch": round(state.step / plan.steps_per_epoch, 4),
            "samples": state.samples,
            **{k: values[i] / world for i, k in enumerate(keys)},
            "lr": lr,
            "imgs_per_sec": (state.samples - self.samples0) / max(elapsed, 1e-9),
            "data_wait_frac": data_wait / world / max(elapsed, 1e-9),
            "skipped": state.skipped,
            "missing_shards": plan.missing_shards,
            "bad_steps": state.bad_steps,
            "overflow_steps": state.overflow_steps,
        }
        if step_losses:
            record.update(step_losses=step_losses, step_lrs=list(self.step_lrs))
        if self.resumed_at is not None:  # the first record of a resumed run
            record["resumed_at"], self.resumed_at = self.resumed_at, None
        self.restart(state)
        if self.rank == 0:
            self._emit(record, "train")
        return record

    def _emit(self, record: dict, section: str) -> None:
        """One metrics.jsonl line; each number to the reporters as ``section/key`` (a key that
        names its section already, ``monitor/knn_top1``, as it is)."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        values = {
            k if "/" in k else f"{section}/{k}": v
            for k, v in record.items()
            if k != "step" and isinstance(v, (int, float))
        }
        for reporter in self.reporters:
            reporter.log(values, record["step"])

    def write(self, state: RunState, plan: Plan, values: dict | None, section: str = "val") -> None:
        """An extra record (validation results; the monitor's) at this step, rank 0 only."""
        if self.rank != 0 or not values:
            return
        record = {
            "step": state.step,
            "epoch": round(state.step / plan.steps_per_epoch, 4),
            **values,
        }
        self._emit(record, section)

    def close(self) -> None:
        if self.file:
            self.file.close()
        for reporter in self.reporters:
            reporter.close()
