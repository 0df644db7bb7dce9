"""compiled-run: a whole pretraining run with ``model.compile`` on, against the same run eager.

gpu-step times the compiled step alone (``model.compile``, off by default: config.py); a run
also calls the monitor and previews (other batch shapes: recompiles) and writes checkpoints.
Each run is the real command under the real launcher (``deepspeed --num_gpus 1 --module
mpp.commands.pretrain``) on the doctor's synthetic JPEG shards, its first shard also the
held-out images of the monitor and the previews (drawn to TensorBoard); the launcher's output
is kept with ``TORCH_LOGS=recompiles,graph_breaks``. Per run: exit status, wall seconds, median
and slowest img/s of the logging windows after the first, data wait, last loss, monitor
records, checkpoints, recompiles and graph breaks.

For each ``--decode`` mode (``data.decode``: JPEGs decoded by the workers, or batched on the GPU
by nvJPEG in the training process) a pair of runs, eager then compiled. On a GPU: mae_b16
(ViT-B/16, batch 256, ZeRO-0 bf16) for 60 steps on 15,616 images in 32 shards, the monitor,
previews and a checkpoint every 30. ``--quick`` or no GPU: the doctor's tiny CPU model, 6 steps.

    python -m benchmarks compiled-run --decode cpu,gpu --keep runs/cr
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from mpp.tools.measure import format_table

# one pass of steps + 1 batches (an epoch's start only in the first, untimed window: the doctor's
# engine rows say why); the monitor, previews and a checkpoint at 30 (and 60), so three of the
# five timed windows (10 steps each, the first one's compile left out) hold none of them
GPU = {"shards": 32, "steps": 60, "every": 30, "ckpt_every": 30, "log_every": 10}
CPU = {"shards": 4, "steps": 6, "every": 3, "ckpt_every": 3, "log_every": 2}


def add_arguments(p: Any) -> None:
    p.add_argument("--config", default="mae_b16", help="the shipped config the runs start from")
    p.add_argument("--keep", help="a folder to keep the runs in (default: a temporary one)")
    p.add_argument(
        "--decode", default="auto", help="data.decode of each pair of runs, comma-separated"
    )


def run(
    quick: bool = False, config: str = "mae_b16", keep: str | None = None, decode: str = "auto"
) -> dict[str, Any]:
    from mpp.build import build_encoder
    from mpp.config import apply_overrides, validate
    from mpp.tools.doctor.engine_run import doctor_config, write_synthetic_shards

    cuda = torch.cuda.is_available() and not quick
    size = GPU if cuda else CPU
    work = Path(keep or tempfile.mkdtemp(prefix="compiled-run-"))
    raw = doctor_config(config, cuda, quick=False, shards="pending")
    img_size = build_encoder(validate(raw, config)).patch_embed.img_size[0]
    images = (size["steps"] + 1) * raw["train"]["batch_size"]
    shards = write_synthetic_shards(work / "shards", img_size, images, size["shards"])
    first = sorted(str(p) for p in (work / "shards").glob("*.tar"))[0]
    sets = {
        "data.train_shards": shards,
        "data.val_shards": first,
        "train.max_steps": size["steps"],
        "train.log_every": size["log_every"],
        "train.monitor_every": size["every"],
        "train.preview_every": size["every"],
        "train.ckpt_every": size["ckpt_every"],
        # a reporter, or the previews draw nothing (mpp.train.preview.build_preview)
        "train.report_to": ["tensorboard"],
    }
    if cuda:
        sets["data.num_workers"] = max(1, min(14, (os.cpu_count() or 2) - 2))
    rows, ratios = [], {}
    for mode in decode.split(","):
        pair = []
        for compiled in (False, True):
            over = {**sets, "data.decode": mode, "model.compile": compiled}
            run_raw = apply_overrides(raw, [f"{k}={json.dumps(v)}" for k, v in over.items()])
            name = f"{mode}-{'compiled' if compiled else 'eager'}"
            pair.append(one_run(run_raw, work / name, cuda))
        rows += pair
        if pair[0].get("imgs_per_sec") and pair[1].get("imgs_per_sec"):
            ratios[mode] = pair[1]["imgs_per_sec"] / pair[0]["imgs_per_sec"]
    return {
        "setting": {
            "config": config,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__,
            "images": images,
            "shards": size["shards"],
            **{k: v for k, v in sets.items() if k not in ("data.train_shards", "data.val_shards")},
            "batch": raw["train"]["batch_size"],
            "model": raw["model"]["name"],
        },
        "rows": rows,
        "compiled_over_eager_imgs_per_sec": ratios,
        "goal": "each compiled run exits 0 with its monitor and checkpoints; img/s against eager",
        "work": str(work),
    }


def one_run(raw: dict[str, Any], work: Path, cuda: bool) -> dict[str, Any]:
    """The launcher run of ``raw`` in ``work``: its figures, read back from what it wrote."""
    from mpp.tools.doctor.engine_run import launcher_run, read_train_records
    from mpp.train.metrics import read_records

    work.mkdir(parents=True, exist_ok=True)
    config = work / "config.json"
    config.write_text(json.dumps(raw, indent=1))
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a run left by an earlier --keep would go on
    os.environ["TORCH_LOGS"] = "recompiles,graph_breaks"
    try:
        r, wall = launcher_run(config, run_dir, timeout=150 if cuda else 300)
    finally:
        os.environ.pop("TORCH_LOGS", None)
    log = "" if r is None else f"{r.stdout}\n{r.stderr}"
    (work / "launcher.log").write_text(log)
    row: dict[str, Any] = {
        "decode": raw["data"]["decode"],
        "compile": raw["model"]["compile"],
        "rc": "timeout" if r is None else r.returncode,
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
            imgs_per_sec=ips[len(ips) // 2],
            slowest_imgs_per_sec=ips[0],
            data_wait=sorted(m["data_wait_frac"] for m in train)[len(train) // 2],
            loss_last=train[-1]["loss"],
        )
    row["monitor_records"] = len(read_records(run_dir, "monitor"))
    row["checkpoints"] = len(list((run_dir / "checkpoints").glob("step*")))
    if row["rc"] != 0:
        row["tail"] = log.strip().splitlines()[-5:]
    return row


def render(result: dict[str, Any]) -> str:
    columns = [
        ("decode", "decode", ""),
        ("compile", "compile", ""),
        ("rc", "exit", ""),
        ("wall_s", "wall s", ".1f"),
        ("steps", "steps", ""),
        ("imgs_per_sec", "img/s (median)", ".1f"),
        ("slowest_imgs_per_sec", "slowest window", ".1f"),
        ("data_wait", "data wait", ".3f"),
        ("loss_last", "last loss", ".4f"),
        ("checkpoints", "checkpoints", ""),
        ("monitor_records", "monitor", ""),
        ("recompiles", "recompiles", ""),
        ("graph_breaks", "graph breaks", ""),
    ]
    s = result["setting"]
    ratios = result["compiled_over_eager_imgs_per_sec"]
    head = (
        f"{s['config']} ({s['model']}, batch {s['batch']}) on {s['device']}, torch {s['torch']}, "
        f"{s['images']} images in {s['shards']} shards"
    )
    tail = "compiled / eager img/s: " + (
        ", ".join(f"decode {m} x{r:.2f}" for m, r in ratios.items()) or "-"
    )
    return "\n".join([head, format_table(result["rows"], columns), tail])
