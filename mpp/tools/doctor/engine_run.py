"""The doctor's engine rows: a short run of the real CLI under the real launcher, read back from its
metrics.jsonl, then on a GPU the same config's step measured in this process against the planner
(docs/ARCHITECTURE.md §6). On a CPU the run is one gloo rank on a tiny model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE
from typing import Any

import numpy as np
import torch
from PIL import Image

from mpp.config import apply_overrides, resolve_config_path, validate
from mpp.data.writer import ImageEncoding, WriterOptions, from_arrays, shard_spec, write_shards
from mpp.parallel.launch import deepspeed_cmd, job_env
from mpp.tools.doctor import FAIL, PASS, WARN, Row, needs_gpu
from mpp.tools.planner.hardware import GPUS
from mpp.train.metrics import read_records

SECTION = "engine"
# a CPU check of the path, not a figure: seconds per run (tests/conftest.py's tiny model)
CPU_RUN = {
    "model": {"name": "vit_tiny_patch4_16", "depth": 2, "embed_dim": 32, "num_heads": 2},
    "decoder": {"decoder_dim": 32, "decoder_depth": 1, "decoder_heads": 2},
    "images": 64,
    "batch": 16,
    "max_steps": 4,
    "log_every": 2,
    "num_workers": 1,
}
# on a GPU the run is one pass of max_steps + 1 batches: an epoch's start (0.5-0.8 s at batch 256
# on 2 CPU workers, BENCHMARKS.md) falls in the warm-up record, not in the data wait read off
# the others (with 2-batch epochs the H200's run waited 31 % of the time)
GPU_RUN = {"max_steps": 40, "log_every": 10}
GPU_RUN_QUICK = {"max_steps": 12, "log_every": 4}
DATA_WAIT_MAX = 0.05  # share of the run's time spent waiting for a batch, above which the loader starves the GPU


def doctor_config(base: str, cuda: bool, quick: bool, shards: str) -> dict[str, Any]:
    """``base`` (a shipped config) as the doctor runs it: one rank, micro batch = batch (no
    accumulation), a few steps, one final checkpoint; on a CPU the tiny model of CPU_RUN."""
    raw = json.loads(resolve_config_path(base).read_text())
    t = raw.get("train", {})
    if cuda:
        run = GPU_RUN_QUICK if quick else GPU_RUN
        batch = t.get("micro_batch_size") or t.get("max_micro_batch_size") or 64
        sets = {}
    else:
        run, batch = CPU_RUN, CPU_RUN["batch"]
        sets = {
            "model": CPU_RUN["model"],
            "data.num_workers": CPU_RUN["num_workers"],
            "data.shuffle_buffer": 64,
        }
        if raw.get("objective", {}).get("name", "mpp") != "mpp":
            sets.update({f"objective.{k}": v for k, v in CPU_RUN["decoder"].items()})
    sets.update(
        {
            "name": "doctor",
            "data.train_shards": shards,
            "train.batch_size": batch,
            "train.micro_batch_size": None,
            "train.max_micro_batch_size": None,
            "train.max_steps": run["max_steps"],
            "train.epochs": None,
            "train.log_every": run["log_every"],
            "train.ckpt_every": 10**6,
            "train.report_to": [],
        }
    )
    return apply_overrides(raw, [f"{k}={json.dumps(v)}" for k, v in sets.items()])


def write_synthetic_shards(out_dir: Path, img_size: int, count: int, shards: int = 4) -> str:
    """``count`` smooth random JPEGs (8x8 noise upsampled: decoding costs what a photo costs,
    unlike noise) through the project's writer, in ``shards`` shards; the shard spec."""
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (count, 8, 8, 3), dtype=np.uint8)
    images = [
        np.asarray(Image.fromarray(a).resize((img_size, img_size), Image.Resampling.BICUBIC))
        for a in small
    ]
    paths = write_shards(
        from_arrays(images),
        out_dir,
        options=WriterOptions(max_count=max(1, count // shards), overwrite=True, progress=False),
        encoding=ImageEncoding(reencode="jpeg"),
    )
    return shard_spec(out_dir, "data", len(paths))


def launcher_run(
    config: Path, run_dir: Path, timeout: int
) -> tuple[subprocess.CompletedProcess | None, float]:
    """``deepspeed --num_gpus 1 --module mpp.commands.pretrain --config C --output-dir D``:
    (result or None on timeout, wall s)."""
    cmd = deepspeed_cmd(
        ["--num_gpus", "1"],
        "mpp.commands.pretrain",
        ["--config", str(config), "--output-dir", str(run_dir)],
    )
    start = time.perf_counter()
    # its own process group, killed whole on a timeout: the launcher's children (the training
    # process, its data workers) would otherwise outlive it, holding the GPU
    with subprocess.Popen(
        cmd, env=job_env(), stdout=PIPE, stderr=PIPE, text=True, start_new_session=True
    ) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(p)
            return None, time.perf_counter() - start
        except BaseException:  # an interrupt: nothing of the run left behind either
            _kill_group(p)
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err), time.perf_counter() - start


def _kill_group(p: subprocess.Popen) -> None:
    """The launcher's process group killed, and whatever under it left the group."""
    import psutil

    try:
        tree = psutil.Process(p.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:  # all gone already
        pass
    for proc in tree:
        try:
            proc.kill()
        except psutil.Error:
            pass
    p.communicate()


def read_train_records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's training records (those with img/s), the first one dropped as warm-up when
    there are more (it holds the allocations, the first all-reduce, the workers' start)."""
    train = read_records(run_dir, "train")
    return train[1:] if len(train) > 1 else train


def run_row(
    raw: dict[str, Any], r: subprocess.CompletedProcess | None, wall: float, run_dir: Path
) -> Row:
    check = "deepspeed launcher run"
    if r is None:
        return Row(
            SECTION, check, FAIL, f"pretrain/run.py did not finish in {wall:.0f} s (log: {run_dir})"
        )
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["no output"])[-1]
        return Row(
            SECTION,
            check,
            FAIL,
            f"pretrain/run.py exited {r.returncode}: {tail[:300]} (log: {run_dir.parent}/launcher.log)",
        )
    records = read_train_records(run_dir)
    if not records:
        return Row(SECTION, check, FAIL, f"no training record in {run_dir}/metrics.jsonl")
    ips = float(np.median([m["imgs_per_sec"] for m in records]))
    wait = float(np.median([m["data_wait_frac"] for m in records]))
    t = raw["train"]
    values = {
        "imgs_per_sec": ips,
        "data_wait_frac": wait,
        "steps": records[-1]["step"],
        "batch": t["batch_size"],
        "loss_last": records[-1]["loss"],
        "wall_s": wall,
        "run_dir": str(run_dir),
    }
    what = f"{raw['objective']['name']} {raw['model']['name']}, batch {t['batch_size']}, {values['steps']} steps"
    reason = f"{what}: {ips:.1f} img/s, data wait {100 * wait:.1f} % of the time"
    if wait > DATA_WAIT_MAX:
        return Row(
            SECTION,
            check,
            WARN,
            reason + f" (> {100 * DATA_WAIT_MAX:.0f} %: raise data.num_workers)",
            values,
        )
    return Row(SECTION, check, PASS, reason, values)


def plan_for(config: Path, gpu_name: str, out: Path) -> tuple[dict[str, Any] | None, str]:
    """``python -m mpp.tools.planner CONFIG --gpus 1 --gpu KIND --out F``: (its JSON, "") or (None, why)."""
    kind = next((k for k in GPUS if k in gpu_name.lower()), None)
    if kind is None:
        return None, f"plan unavailable: the planner knows {', '.join(GPUS)}, not {gpu_name!r}"
    cmd = [
        sys.executable,
        "-m",
        "mpp.tools.planner",
        str(config),
        "--gpus",
        "1",
        "--gpu",
        kind,
        "--out",
        str(out),
    ]
    try:
        r = subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return None, "plan unavailable: python -m mpp.tools.planner took over 600 s"
    if r.returncode != 0 or not out.is_file():
        tail = (r.stderr.strip().splitlines() or ["it wrote no JSON"])[-1]
        return (
            None,
            f"plan unavailable: python -m mpp.tools.planner exited {r.returncode} ({tail[:200]})",
        )
    return json.loads(out.read_text()), ""


def engine_rows(out_dir: Path, base: str, quick: bool = False) -> list[Row]:
    """The launcher run on this machine; on a GPU, the plan and the in-process step against it."""
    from mpp.build import build_encoder

    cuda = torch.cuda.is_available()
    work = out_dir / "engine"
    raw = doctor_config(base, cuda, quick, shards="pending")
    cfg = validate(raw, base)
    img_size = build_encoder(cfg).patch_embed.img_size[0]
    steps = (GPU_RUN_QUICK if quick else GPU_RUN)["max_steps"]
    count = (steps + 1) * raw["train"]["batch_size"] if cuda else CPU_RUN["images"]
    raw["data"]["train_shards"] = write_synthetic_shards(work / "shards", img_size, count)
    config = work / "config.json"
    config.write_text(json.dumps(raw, indent=1))
    shutil.rmtree(work / "run", ignore_errors=True)  # its own scratch: each check starts afresh
    r, wall = launcher_run(config, work / "run", timeout=600 if cuda else 240)
    if r is not None:
        (work / "launcher.log").write_text(f"$ {' '.join(r.args)}\n{r.stdout}\n{r.stderr}")
    rows = [run_row(raw, r, wall, work / "run")]
    if not cuda:
        what = {
            "MFU vs plan": "compares the run's model FLOP/s with the planner's MFU ceiling",
            "peak memory vs plan": "compares the step's peak memory with the planner's prediction",
            "host syncs per step": "counts the step's host syncs (torch.cuda.set_sync_debug_mode)",
            "torch.compile": "times the step with and without torch.compile",
        }
        return rows + [needs_gpu(SECTION, check, w) for check, w in what.items()]
    from mpp.tools.doctor.engine_gpu import gpu_rows

    return rows + gpu_rows(
        config, rows[0], plan_for(config, torch.cuda.get_device_name(), work / "plan.json"), quick
    )
