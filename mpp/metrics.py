"""The training log: metrics.jsonl and TensorBoard on rank 0, averaged over ranks at log
steps only, so the step itself never waits for the host."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mpp.plan import Plan, RunState

log = logging.getLogger("mpp.metrics")


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


class MetricLog:
    """metrics.jsonl + TensorBoard on rank 0; sums metrics on the device between log steps so
    the step itself never waits for the host."""

    def __init__(self, run_dir: Path, rank: int, state: RunState) -> None:
        """Continues at ``state``: after a resume, records past its step (written before the run
        stopped, and about to be replayed) are dropped, so each step is in the file once."""
        self.rank = rank
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.data_wait = 0.0
        self.t0 = time.perf_counter()
        self.samples0 = state.samples
        self.file = None
        if rank == 0:
            path = run_dir / "metrics.jsonl"
            if path.is_file():
                drop_records_after(path, state.step)
            self.file = open(path, "a")
        self.tb = None
        if rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tb"))
            except ImportError:  # tensorboard is optional at run time
                log.warning("tensorboard not installed: no event files")

    def add(self, metrics: dict[str, torch.Tensor], data_wait: float) -> None:
        for k, v in metrics.items():
            v = v.detach().float()
            self.sums[k] = self.sums[k] + v if k in self.sums else v.clone()
        self.count += 1
        self.data_wait += data_wait

    def flush(self, state: RunState, plan: Plan, lr: float, skipped: int) -> dict[str, float] | None:
        """All-reduce the averages (every rank calls this), write one record on rank 0."""
        keys = sorted(self.sums)
        dev = self.sums[keys[0]].device
        extra = torch.tensor([float(skipped), self.data_wait], device=dev)
        stats = torch.cat([torch.stack([self.sums[k] / self.count for k in keys]), extra])
        dist.all_reduce(stats)
        values = stats.tolist()
        world = dist.get_world_size()
        elapsed = time.perf_counter() - self.t0
        record = {
            "step": state.step,
            "epoch": round(state.step / plan.steps_per_epoch, 4),
            "samples": state.samples,
            **{k: values[i] / world for i, k in enumerate(keys)},
            "lr": lr,
            "imgs_per_sec": (state.samples - self.samples0) / max(elapsed, 1e-9),
            "data_wait_frac": values[-1] / world / max(elapsed, 1e-9),
            "skipped": int(values[-2]),
            "missing_shards": plan.missing_shards,
            "bad_steps": state.bad_steps,
            "overflow_steps": state.overflow_steps,
        }
        self.sums, self.count, self.data_wait = {}, 0, 0.0
        self.t0, self.samples0 = time.perf_counter(), state.samples
        if self.rank == 0:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            if self.tb is not None:
                for k, v in record.items():
                    if k != "step":
                        self.tb.add_scalar(f"train/{k}", v, state.step)
        return record

    def write(self, state: RunState, plan: Plan, values: dict | None) -> None:
        """An extra record (e.g. validation results) at this step, rank 0 only."""
        if self.rank != 0 or not values:
            return
        record = {"step": state.step, "epoch": round(state.step / plan.steps_per_epoch, 4), **values}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(f"val/{k}", v, state.step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
