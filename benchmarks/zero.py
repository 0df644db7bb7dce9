"""zero: step time and peak memory per rank of ZeRO stages 1-3 against stage 0, 2 CPU ranks.

Each stage is a real launcher run of the pretraining CLI,
``deepspeed --num_gpus 2 benchmarks/zero_rank.py --config C --set
deepspeed.zero_optimization.stage=S`` (``zero_rank`` is ``pretrain/run.py``'s main plus a
per-rank RSS record). Step time comes from the run's metrics.jsonl ``imgs_per_sec``, the
first log interval skipped as warm-up; memory is each rank's RSS high-water mark before the
final checkpoint, next to the model-state bytes ZeRO's paper predicts for fp32 + Adam.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import clone_env, format_table, median
from mpp.parallel.launch import deepspeed_cmd, job_env
from mpp.train.metrics import read_records

WORLD = 2
SETTINGS = {
    # ViT-S: 22M parameters, 350 MB of fp32 Adam state at stage 0, what ZeRO partitions;
    # 64 px (16 patches) keeps the step short enough for 4 launcher runs in minutes
    "full": dict(
        stages=[0, 1, 2, 3],
        max_steps=24,
        log_every=4,
        batch=16,
        model={"name": "vit_small_patch16_64"},
    ),
    "quick": dict(
        stages=[0, 3],
        max_steps=4,
        log_every=2,
        batch=16,
        model={"name": "vit_tiny_patch4_16", "depth": 2, "embed_dim": 32, "num_heads": 2},
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stages", type=int, nargs="+", help="ZeRO stages to run (default: the setting's)"
    )


def bench_config(s: dict) -> dict[str, Any]:
    """The pretraining config every stage runs (MPP on the built-in digits, fp32, Adam)."""
    return {
        "name": "zero-bench",
        "model": s["model"],
        "objective": {"name": "mpp"},
        "data": {"builtin": "digits", "num_workers": 1, "shuffle_buffer": 64},
        "optim": {"name": "adam", "lr": 1e-4, "warmup_steps": 2},
        "train": {
            "batch_size": s["batch"],
            "max_steps": s["max_steps"],
            "log_every": s["log_every"],
            "ckpt_every": 10**6,
            "precision": "fp32",
        },
        "deepspeed": {"zero_optimization": {"stage": 0}},
    }


def model_state_mib(num_params: int, stage: int, world: int = WORLD) -> float:
    """fp32 params (4) + grads (4) + Adam moments (8) bytes per parameter, per rank, as ZeRO
    partitions them: stage 1 the moments, 2 also the grads, 3 also the params."""
    params, grads, moments = 4.0, 4.0, 8.0
    if stage >= 1:
        moments /= world
    if stage >= 2:
        grads /= world
    if stage >= 3:
        params /= world
    return num_params * (params + grads + moments) / 2**20


def rank_env() -> dict[str, str]:
    """The launch helper's environment, one core per rank. torchrun sets OMP_NUM_THREADS=1; the
    deepspeed launcher leaves every rank at all cores, and 2 ranks x 2 threads on 2 cores wait
    on each other's OpenMP barriers (measured: a tiny step 10x slower)."""
    env = job_env()
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORLD)))
    return clone_env(env)


def run_stage(config: Path, stage: int, work: Path, timeout: int = 600) -> dict[str, Any]:
    """One launcher run at ``stage``: its step time from metrics.jsonl and per-rank peak RSS."""
    out, rss_dir = work / f"stage{stage}", work / f"rss{stage}"
    rss_dir.mkdir()
    cmd = deepspeed_cmd(
        ["--num_gpus", str(WORLD)],
        "benchmarks.zero_rank",
        [
            "--config",
            str(config),
            "--set",
            f"deepspeed.zero_optimization.stage={stage}",
            "--output-dir",
            str(out),
        ],
    )
    start = time.perf_counter()
    r = subprocess.run(
        cmd,
        env={**rank_env(), "MPP_BENCH_RSS_DIR": str(rss_dir)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise RuntimeError(
            f"zero stage {stage} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        )
    records = read_records(out, "train")
    # the first interval holds the warm-up (allocations, first all-reduce)
    timed = records[1:] or records
    ips = median([m["imgs_per_sec"] for m in timed])
    ranks = [json.loads((rss_dir / f"rank{i}.json").read_text()) for i in range(WORLD)]
    return {
        "stage": stage,
        "imgs_per_sec": ips,
        "timed_steps": timed[-1]["step"] - records[0]["step"]
        if len(records) > 1
        else records[0]["step"],
        "loss_last": records[-1]["loss"],
        "rank_peak_mib": [rk["train_peak_mib"] for rk in ranks],
        "rank_baseline_mib": [rk["baseline_mib"] for rk in ranks],
        "rank_before_init_mib": [rk["before_init_mib"] for rk in ranks],
        "rank_after_init_mib": [rk["after_init_mib"] for rk in ranks],
        "rank_after_steps_mib": [rk["after_steps_mib"] for rk in ranks],
        "launcher_wall_s": wall,
    }


def run(quick: bool = False, stages: list[int] | None = None) -> dict[str, Any]:
    from mpp.build import build_objective
    from mpp.config import validate

    s = SETTINGS["quick" if quick else "full"]
    stages = stages or s["stages"]
    cfg = bench_config(s)
    num_params = sum(
        p.numel() for p in build_objective(validate(cfg)).parameters() if p.requires_grad
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpp-zero-") as tmp:
        work = Path(tmp)
        config = work / "config.json"
        config.write_text(json.dumps(cfg))
        for stage in stages:
            row = run_stage(config, stage, work)
            row["step_s"] = s["batch"] / row["imgs_per_sec"]
            row["peak_mib"] = max(row["rank_peak_mib"])
            row["added_mib"] = max(
                p - b for p, b in zip(row["rank_peak_mib"], row["rank_baseline_mib"], strict=True)
            )
            row["model_state_mib"] = model_state_mib(num_params, stage)
            # rank 0's steps: model built, deepspeed.initialize (ZeRO's buffers), training
            row["build_mib"] = row["rank_before_init_mib"][0] - row["rank_baseline_mib"][0]
            row["init_mib"] = row["rank_after_init_mib"][0] - row["rank_before_init_mib"][0]
            row["train_mib"] = row["rank_peak_mib"][0] - row["rank_after_init_mib"][0]
            row["resident_mib"] = max(row["rank_after_steps_mib"])
            rows.append(row)
    ref = rows[0]
    for r in rows:
        r["step_vs_first"] = r["step_s"] / ref["step_s"]
        r["added_vs_first"] = r["added_mib"] / ref["added_mib"]
    return {
        "setting": {
            **s,
            "stages": stages,
            "world_size": WORLD,
            "num_params": num_params,
            "precision": "fp32",
            "optimizer": "adam",
            "objective": "mpp",
            "omp_num_threads_per_rank": int(rank_env()["OMP_NUM_THREADS"]),
        },
        "rows": rows,
    }


def render(result: dict[str, Any]) -> str:
    s = result["setting"]
    head = (
        f"{s['model']['name']} MPP, {s['num_params'] / 1e6:.1f}M params, fp32 Adam, global batch {s['batch']} "
        f"on {s['world_size']} CPU ranks (gloo), {s['max_steps']} steps, first {s['log_every']} skipped"
    )
    first = result["rows"][0]["stage"]
    table = format_table(
        result["rows"],
        [
            ("stage", "ZeRO stage", "d"),
            ("step_s", "s/step", ".3f"),
            ("step_vs_first", f"step ÷ stage {first}", ".2f"),
            ("peak_mib", "peak RSS/rank MiB", ".0f"),
            ("added_mib", "added by training MiB", ".0f"),
            ("added_vs_first", f"added ÷ stage {first}", ".2f"),
            ("build_mib", "of which: build", ".0f"),
            ("init_mib", "ds.initialize", ".0f"),
            ("train_mib", "steps", ".0f"),
            ("resident_mib", "resident after steps MiB", ".0f"),
            ("model_state_mib", "model states MiB (theory)", ".0f"),
        ],
    )
    return f"{head}\n{table}"
