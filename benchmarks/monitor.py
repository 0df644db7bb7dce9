"""monitor: what ``train.monitor_every`` costs a run. One monitor call (the k-NN of a bank of 20
labelled images per class against the held-out images, and the objective's own held-out signal)
against one training step (forward, backward, Adam) of the demo configs' models and batches, on
the built-in digits (200 bank and 300 held-out images), interleaved; the overhead at
``monitor_every`` = N is monitor / (N x step). Goal: at most two percent of a run at the default
(1000) and at the demo configs' 200.

For the ViT-B/16 recipes the same ratio is counted in model FLOPs (``flops.step_flops``; their
steps cannot run here): a monitor call is a full-image encoder forward of every bank and
held-out image plus the objective's forward of the held-out ones, with ImageNet's 1,000 classes
(a bank of 20,000) and 50,000 validation images.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.common import demo_step, format_table, interleaved_times, median

CONFIGS = ("mpp_demo", "mae_demo", "hpm_demo")
RECIPES = ("mpp_b16", "mae_b16", "hpm_b16")
EVERY = (200, 1000)
IMAGENET_BANK, IMAGENET_VAL = 20 * 1000, 50_000


def run(quick: bool = False) -> dict[str, Any]:
    rows = [measure(name, quick) for name in (CONFIGS[:1] if quick else CONFIGS)]
    flops = [recipe_flops(name) for name in (RECIPES[:1] if quick else RECIPES)]
    return {"every": list(EVERY), "rows": rows, "recipes": flops, "goal": "overhead_pct <= 2"}


def measure(name: str, quick: bool) -> dict[str, Any]:
    """One demo config's step and monitor call, interleaved; medians."""
    from mpp.data import digits_shards
    from mpp.data.transforms import PixelFormat
    from mpp.train.monitor import Images, Monitor, load_images

    cfg, objective, size, batch, step = demo_step(name, quick)
    settings = {"rank": 0, "world_size": 1, "num_workers": 0, "with_keys": True}
    settings.update(allow_pipe=False, pixels=PixelFormat(3))
    val = load_images(digits_shards(size)["val"], size, settings)
    per_class = {}
    # the bank: 20 per class (the default), drawn here from the held-out images (the same cost)
    for i, y in enumerate(val.labels.tolist()):
        per_class.setdefault(y, []).append(i)
    pick = torch.tensor(sorted(i for ids in per_class.values() for i in ids[:20]))
    bank = Images(val.images[pick], val.labels[pick], [val.keys[i] for i in pick])
    if quick:
        val = Images(val.images[:40], val.labels[:40], val.keys[:40])
    mean, std = cfg.data.mean, cfg.data.std
    monitor = Monitor(1, bank, val, cfg.monitor, mean, std, torch.device("cpu"))

    times = interleaved_times(
        {"step": step, "monitor": lambda: monitor(objective, 1)}, 2 if quick else 5
    )
    step_s, monitor_s = median(times["step"]), median(times["monitor"])
    row = {
        "config": name,
        "batch": batch,
        "bank": len(bank.keys),
        "held_out": len(val.keys),
        "step_ms": 1e3 * step_s,
        "monitor_ms": 1e3 * monitor_s,
    }
    for every in EVERY:
        row[f"overhead_pct_{every}"] = 100 * monitor_s / (every * step_s)
    return row


def recipe_flops(name: str) -> dict[str, Any]:
    """A ViT-B/16 recipe's monitor against its training, in model FLOPs (meta device)."""
    from mpp.tools.flops import _encoder, step_flops
    from mpp.tools.planner.fake_step import build_on_meta
    from mpp.train.plan import load_plan_config

    cfg, _ = load_plan_config(name, [])
    model = build_on_meta(cfg)
    flops = step_flops(model)
    encoder = model.encoder
    full = _encoder(encoder, encoder.num_patches)
    monitor = (IMAGENET_BANK + IMAGENET_VAL) * full + IMAGENET_VAL * flops.forward
    row = {"config": name, "batch": cfg.train.batch_size, "step_gflop_per_image": flops.step / 1e9}
    row["monitor_pflop"] = monitor / 1e15
    for every in EVERY:
        row[f"overhead_pct_{every}"] = 100 * monitor / (every * cfg.train.batch_size * flops.step)
    return row


def render(result: dict[str, Any]) -> str:
    overhead = [(f"overhead_pct_{n}", f"at every {n} %", ".2f") for n in result["every"]]
    measured = format_table(
        result["rows"],
        [
            ("config", "config", ""),
            ("batch", "batch", ""),
            ("bank", "bank", ""),
            ("held_out", "held out", ""),
            ("step_ms", "step ms", ".1f"),
            ("monitor_ms", "monitor ms", ".1f"),
            *overhead,
        ],
    )
    counted = format_table(
        result["recipes"],
        [
            ("config", "recipe (model FLOPs)", ""),
            ("batch", "batch", ""),
            ("step_gflop_per_image", "step GFLOP/img", ".1f"),
            ("monitor_pflop", "monitor PFLOP", ".2f"),
            *overhead,
        ],
    )
    return f"{measured}\n\n{counted}"
