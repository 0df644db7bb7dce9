"""compiled-run: whole pretraining runs under the real launcher, eager and compiled, against their
step alone (issue 49 §6: does a whole run reach its step's speed?).

Each run is the real command under the real launcher (``deepspeed --num_gpus 1 --module
mpp.commands.pretrain``) on photo-like JPEGs of ImageNet's sizes (``imagenet_sizes``: mostly
500 x 375, 375 x 500 and 500 x 333, some smaller, some larger; ``benchmarks.data_timing``'s
synthetic photos, so a decode costs what a photo's costs), written once into ``KEEP/shards`` and
shared by every run that finds them there (``--shards-only`` writes them and stops). Per run, for
each ``--config`` x ``--decode`` (``data.decode``: the workers decode, or nvJPEG in the training
process) x ``--compile`` (``model.compile`` set explicitly: its default is auto): exit status,
wall seconds, the median and slowest img/s of the logging windows after the first (which holds
the start and the compile), the median data wait, last loss, recompiles and graph breaks
(``TORCH_LOGS=recompiles,graph_breaks``). With ``--step-json`` (gpu-step's JSON at the runs'
batch, run with ``--compile`` for the compiled rows' reference) each row also gets its step
alone's img/s and **the run's img/s over it**. The goals (issue 49): a run >= 0.9 of its step's
img/s, data wait <= 5 % of its time.

Only one run of a call (``--extras last``, the default; ``all``, ``none``) also calls the monitor
and the previews (to TensorBoard) and writes a checkpoint half-way: the fourth GPU session showed
them working compiled, and they are not what is measured now; every run writes its final
checkpoint and exports its encoder. ``--budget-s`` caps the whole call: each launcher run's
limit is cut to what is left, a run that cannot start in time is a "skipped" row. Each run's
checkpoints (GBs) are removed once counted; its log, config and metrics stay in KEEP.

On a GPU: batch 256 (the configs' micro batch, one rank), 60 steps on 15,616 images (61 batches:
one pass, the epoch's start in the untimed first window) in 32 shards, min(16, cores - 2) data
workers, a record every 10 steps. ``--quick`` or no GPU: the doctor's tiny CPU model, 6 steps.

    python -m benchmarks compiled-run --config mae_b16,mpp_b16 --decode cpu,gpu --keep runs/cr \\
        --step-json runs/gc/gpu-step-256.json
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mpp.tools.measure import format_table

# one pass of steps + 1 batches (an epoch's start only in the first, untimed window: the doctor's
# engine rows say why); the extras (monitor, previews, a checkpoint) at `extras_every`
GPU = {"shards": 32, "steps": 60, "log_every": 10, "extras_every": 30}
CPU = {"shards": 4, "steps": 6, "log_every": 2, "extras_every": 3}
WORKERS_MAX = 16
# each launcher run's limit in s: eager ~30-40 s on the H200 of 2026-11-27 with its start; a
# compile ~40-60 s cold, a few s when inductor's cache holds the graph (gpu-step --compile's)
RUN_TIMEOUT = {False: 90, True: 150}
CPU_TIMEOUT = 300
COMPILE = {"false": False, "true": True, "auto": "auto"}  # --compile's words: model.compile
MIN_RUN_S = 30  # a run left less than this by --budget-s is skipped, not started
GOALS = {"run_over_step_min": 0.9, "data_wait_max": 0.05}

# ImageNet-1k train's image sizes as drawn here (approximate shares, not its exact histogram):
# most images 500 px on the long side (78 %), then smaller ones (long side 200-499, 14 %) and
# larger ones (600-1200, 8 %); drawn for 15,616 images: 471 x 419 and 209,000 pixels on average
IMAGENET_SIZES = (
    ((500, 375), 0.40),
    ((375, 500), 0.12),
    ((500, 333), 0.16),
    ((333, 500), 0.06),
    ((500, 500), 0.04),
)
SMALLER, LARGER = (0.14, (200, 499)), (0.08, (600, 1200))
ASPECTS = (4 / 3, 3 / 4, 3 / 2, 2 / 3, 1.0)
SHARDS_VERSION = 1  # written into KEEP/shards/imagenet-like.json: a change rewrites the shards


def add_arguments(p: Any) -> None:
    p.add_argument(
        "--config",
        default="mae_b16",
        help="the shipped configs the runs start from, comma-separated",
    )
    p.add_argument(
        "--keep",
        help="a folder for the shards and runs (default: a temporary one); shards found there "
        "are reused",
    )
    p.add_argument("--decode", default="auto", help="data.decode of the runs, comma-separated")
    p.add_argument(
        "--compile",
        default="false,true",
        help="model.compile of the runs (false, true, auto), comma-separated",
    )
    p.add_argument(
        "--extras",
        choices=["last", "all", "none"],
        default="last",
        help="the runs that also call the monitor and previews and write a checkpoint half-way",
    )
    p.add_argument(
        "--step-json", help="gpu-step's JSON at the runs' batch: each run against its step alone"
    )
    p.add_argument("--steps", type=int, help="steps per run (default 60 on a GPU)")
    p.add_argument(
        "--budget-s", type=float, help="seconds for the whole call: later runs are cut or skipped"
    )
    p.add_argument(
        "--shards-only", action="store_true", help="write the shards into --keep and stop"
    )


def imagenet_sizes(count: int, seed: int = 0) -> list[tuple[int, int]]:
    """``count`` (width, height) drawn from IMAGENET_SIZES, SMALLER and LARGER."""
    rng = np.random.default_rng(seed)
    shares = [p for _, p in IMAGENET_SIZES] + [SMALLER[0], LARGER[0]]
    out = []
    for kind in rng.choice(len(shares), size=count, p=np.array(shares) / sum(shares)):
        if kind < len(IMAGENET_SIZES):
            out.append(IMAGENET_SIZES[kind][0])
            continue
        low, high = (SMALLER if kind == len(IMAGENET_SIZES) else LARGER)[1]
        side, aspect = int(rng.integers(low, high + 1)), ASPECTS[rng.integers(len(ASPECTS))]
        out.append((side, round(side / aspect)) if aspect >= 1 else (round(side * aspect), side))
    return out


def _photo(job: tuple[int, tuple[int, int]]) -> bytes:
    from benchmarks.data_timing import synthetic_jpegs

    seed, (width, height) = job
    return synthetic_jpegs(1, width, height, seed=seed)[0]


def write_imagenet_like_shards(out_dir: Path, count: int, shards: int) -> tuple[str, dict]:
    """``count`` photo-like JPEGs of ImageNet's sizes in ``shards`` shards (through the project's
    writer, the bytes kept), made on every core; kept and reused while ``out_dir`` holds the same
    set. (The shard spec, what was written.)"""
    from mpp.data.writer import WriterOptions, shard_spec, write_shards

    marker = out_dir / "imagenet-like.json"
    want = {"version": SHARDS_VERSION, "count": count, "shards": shards}
    if marker.is_file():
        written = json.loads(marker.read_text())
        if {k: written.get(k) for k in want} == want:
            return shard_spec(out_dir, "data", written["files"]), {**written, "reused": True}
    start = time.perf_counter()
    sizes = imagenet_sizes(count)
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        jpegs = list(pool.map(_photo, enumerate(sizes), chunksize=64))
    paths = write_shards(
        [(d, None) for d in jpegs],
        out_dir,
        options=WriterOptions(max_count=math.ceil(count / shards), overwrite=True, progress=False),
    )
    written = {
        **want,
        "files": len(paths),
        "mean_kib": round(sum(map(len, jpegs)) / len(jpegs) / 1024, 1),
        "mean_pixels": round(sum(w * h for w, h in sizes) / len(sizes)),
        "share_500px": round(sum(max(s) == 500 for s in sizes) / len(sizes), 3),
        "write_s": round(time.perf_counter() - start, 1),
    }
    marker.write_text(json.dumps(written, indent=1))
    return shard_spec(out_dir, "data", len(paths)), {**written, "reused": False}


def step_rates(gpu_step: dict[str, Any]) -> tuple[dict[tuple[str, bool], float], str, int | None]:
    """gpu-step's img/s per (objective, compiled), as shipped, on the attention a run's ``auto``
    takes (xformers where its kernels ran there, else SDPA); that backend, and the batch."""
    rows = [
        r
        for r in gpu_step.get("rows", [])
        if "error" not in r and r.get("lever", "shipped") == "shipped"
    ]
    backend = "xformers" if any(r["attention"] == "xformers" for r in rows) else "sdpa"
    rates = {
        (r["objective"], r["compiled"]): r["imgs_per_sec"]
        for r in rows
        if r["attention"] == backend
    }
    return rates, backend, gpu_step.get("setting", {}).get("batch")


def against_step(rows: list[dict[str, Any]], gpu_step: dict[str, Any] | None) -> None:
    """Each row's step alone (gpu-step's img/s for its objective, compiled or not, at its batch),
    the run's img/s over it and whether both goals are met, in place."""
    rates, backend, batch = step_rates(gpu_step or {})
    for row in rows:
        step = (
            rates.get((row.get("objective"), row.get("compile")))
            if batch == row.get("batch")
            else None
        )
        row["step_imgs_per_sec"] = step
        row["step_attention"] = backend if step else None
        ips, wait = row.get("imgs_per_sec"), row.get("data_wait")
        row["run_over_step"] = ips / step if step and ips else None
        row["met"] = (
            None
            if row["run_over_step"] is None or wait is None
            else row["run_over_step"] >= GOALS["run_over_step_min"]
            and wait <= GOALS["data_wait_max"]
        )


def run(
    quick: bool = False,
    config: str = "mae_b16",
    keep: str | None = None,
    decode: str = "auto",
    compile: str = "false,true",
    extras: str = "last",
    step_json: str | None = None,
    steps: int | None = None,
    budget_s: float | None = None,
    shards_only: bool = False,
) -> dict[str, Any]:
    from mpp.config import apply_overrides
    from mpp.tools.doctor.engine_run import doctor_config

    start = time.perf_counter()
    cuda = torch.cuda.is_available() and not quick
    size = {**(GPU if cuda else CPU), **({"steps": steps} if steps else {})}
    work = Path(keep or tempfile.mkdtemp(prefix="compiled-run-"))
    configs = [c for c in config.split(",") if c]
    raws = {c: doctor_config(c, cuda, quick=False, shards="pending") for c in configs}
    batch = max(raw["train"]["batch_size"] for raw in raws.values())
    images = (size["steps"] + 1) * batch
    spec, shards = write_imagenet_like_shards(work / "shards", images, size["shards"])
    first = sorted(str(p) for p in (work / "shards").glob("*.tar"))[0]
    workers = max(1, min(WORKERS_MAX, (os.cpu_count() or 2) - 2)) if cuda else None
    setting = {
        "configs": configs,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "images": images,
        "shards": shards,
        "steps": size["steps"],
        "log_every": size["log_every"],
        "extras": extras,
        "extras_every": size["extras_every"],
        "num_workers": workers,
        "step_json": step_json,
    }
    result = {"setting": setting, "rows": [], "goals": GOALS, "work": str(work)}
    if shards_only:
        return result
    sets = {
        "data.train_shards": spec,
        "train.max_steps": size["steps"],
        "train.log_every": size["log_every"],
        "train.monitor_every": 0,
        "train.preview_every": 0,
        "train.ckpt_every": 10**6,  # the final checkpoint only
        "train.report_to": [],
        **({"data.num_workers": workers} if workers else {}),
    }
    extra_sets = {
        "data.val_shards": first,  # the monitor's and previews' held-out images
        "train.monitor_every": size["extras_every"],
        "train.preview_every": size["extras_every"],
        "train.ckpt_every": size["extras_every"],
        # a reporter, or the previews draw nothing (mpp.train.preview.build_preview)
        "train.report_to": ["tensorboard"],
    }
    modes = [COMPILE[m.strip().lower()] for m in compile.split(",")]
    runs = [(c, d, m) for c in configs for d in decode.split(",") for m in modes]
    for i, (name, mode, compiled) in enumerate(runs):
        with_extras = extras == "all" or (extras == "last" and i == len(runs) - 1)
        over = {
            **sets,
            **(extra_sets if with_extras else {}),
            "data.decode": mode,
            "model.compile": compiled,
        }
        raw = apply_overrides(raws[name], [f"{k}={json.dumps(v)}" for k, v in over.items()])
        kind = "compiled" if compiled is True else "eager" if compiled is False else "auto"
        label = f"{name}-{mode}-{kind}"
        limit = RUN_TIMEOUT[compiled is not False] if cuda else CPU_TIMEOUT
        if budget_s is not None:
            left = budget_s - (time.perf_counter() - start)
            if left < MIN_RUN_S:
                result["rows"].append(
                    describe(raw, name, with_extras)
                    | {"rc": "skipped", "tail": [f"{left:.0f} s left"]}
                )
                continue
            limit = min(limit, int(left))
        result["rows"].append(one_run(raw, name, work / label, limit, with_extras))
    step = (
        json.loads(Path(step_json).read_text()) if step_json and Path(step_json).is_file() else None
    )
    against_step(result["rows"], step)
    return result


def describe(raw: dict[str, Any], config: str, extras: bool) -> dict[str, Any]:
    return {
        "config": config,
        "objective": raw["objective"]["name"],
        "batch": raw["train"]["batch_size"],
        "decode": raw["data"]["decode"],
        "compile": raw["model"]["compile"],
        "extras": extras,
    }


def one_run(
    raw: dict[str, Any], config: str, work: Path, timeout: int, extras: bool
) -> dict[str, Any]:
    """The launcher run of ``raw`` in ``work`` under ``timeout`` s: its figures, read back from what
    it wrote."""
    from mpp.tools.doctor.engine_run import launcher_run, read_train_records
    from mpp.train.metrics import read_records

    work.mkdir(parents=True, exist_ok=True)
    path = work / "config.json"
    path.write_text(json.dumps(raw, indent=1))
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a run left by an earlier --keep would go on
    os.environ["TORCH_LOGS"] = "recompiles,graph_breaks"
    try:
        r, wall = launcher_run(path, run_dir, timeout=timeout)
    finally:
        os.environ.pop("TORCH_LOGS", None)
    log = "" if r is None else f"{r.stdout}\n{r.stderr}"
    (work / "launcher.log").write_text(log)
    row: dict[str, Any] = describe(raw, config, extras) | {
        "rc": "timeout" if r is None else r.returncode,
        "limit_s": timeout,
        "wall_s": round(wall, 1),
        "recompiles": log.count("Recompiling function"),
        "graph_breaks": log.count("Graph break"),
        "log": str(work / "launcher.log"),
    }
    train = read_train_records(run_dir)
    if train:
        ips = sorted(m["imgs_per_sec"] for m in train)
        row.update(
            steps=train[-1]["step"],
            windows=len(train),
            imgs_per_sec=ips[len(ips) // 2],
            slowest_imgs_per_sec=ips[0],
            data_wait=sorted(m["data_wait_frac"] for m in train)[len(train) // 2],
            loss_last=train[-1]["loss"],
        )
    row["monitor_records"] = len(read_records(run_dir, "monitor"))
    row["checkpoints"] = len(list((run_dir / "checkpoints").glob("step*")))
    # GBs a run (ViT-B/16's weights and Adam's state), not what is measured: the disk is shared
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    if row["rc"] != 0:
        row["tail"] = log.strip().splitlines()[-5:]
    return row


COLUMNS = [
    ("config", "config", ""),
    ("decode", "decode", ""),
    ("compile", "compile", ""),
    ("rc", "exit", ""),
    ("wall_s", "wall s", ".1f"),
    ("imgs_per_sec", "img/s (median)", ".0f"),
    ("slowest_imgs_per_sec", "slowest window", ".0f"),
    ("data_wait", "data wait (<= 0.05)", ".3f"),
    ("step_imgs_per_sec", "step alone img/s", ".0f"),
    ("run_over_step", "run / step (>= 0.9)", ".3f"),
    ("met", "met", ""),
    ("loss_last", "last loss", ".4f"),
    ("recompiles", "recompiles", ""),
    ("graph_breaks", "graph breaks", ""),
    ("extras", "monitor, previews, ckpt", ""),
]


def render(result: dict[str, Any]) -> str:
    s, sh = result["setting"], result["setting"]["shards"]
    written = "reused" if sh.get("reused") else f"written in {sh.get('write_s')} s"
    head = (
        f"{', '.join(s['configs'])} on {s['device']}, torch {s['torch']}: {s['steps']} steps, "
        f"{s['images']} JPEGs of ImageNet's sizes in {sh.get('files')} shards "
        f"({sh.get('mean_kib')} KiB, {sh.get('mean_pixels')} pixels on average; {written}), "
        f"{s['num_workers'] or 1} data workers"
    )
    if not result["rows"]:
        return head
    return "\n".join([head, format_table(result["rows"], COLUMNS)])
