"""gpu-step: ViT-B/16 training steps at 224 px in bf16 on one GPU: images/s and MFU for MPP,
MAE and HPM, xformers against SDPA attention, optionally under torch.compile.

MFU = model FLOP/s (mpp.benchmarks.flops) ÷ 790 TFLOP/s, the dense bf16 matmul throughput
measured on this project's H100/H200 (DESIGN.md §7). Recorded by hand on a GPU machine,
never in CI; on a machine without CUDA it refuses with exit code 2.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from typing import Any

import torch

from mpp.benchmarks.common import (
    Unavailable,
    format_table,
    interleaved_times,
    matmul_roofline,
    median,
)
from mpp.benchmarks.flops import step_flops
from mpp.benchmarks.step import build_contender, make_optimizer, make_step
from mpp.models.attention import _xformers_ops

PEAK_BF16 = 790e12
GOALS = {"mpp_mfu_min": 0.40, "mae_mfu_min": 0.30, "hpm_vs_mae_time_max": 2.0}
OBJECTIVES = ("mpp", "mae", "hpm")
SETTINGS = {
    "full": dict(model="vit_base_patch16_224", overrides={}, batch=128, decoder={}, rounds=10, warmup=3),
    "quick": dict(model="vit_base_patch16_224", overrides={"depth": 2}, batch=16,
                  decoder=dict(decoder_depth=1), rounds=3, warmup=2),
    # --device cpu: the same code on a tiny model, to check the suite runs (not a figure)
    "cpu": dict(model="vit_tiny_patch16_64", overrides={"depth": 2}, batch=4,
                decoder=dict(decoder_dim=64, decoder_depth=1, decoder_heads=4), rounds=2, warmup=1),
}  # fmt: skip
MATMUL_N = {"cuda": 8192, "cpu": 256}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action="store_true", help="also time each objective under torch.compile")
    p.add_argument("--batch", type=int, help="images per step (default: the setting's)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: run the suite's code on a tiny model to check it works (no figures)")  # fmt: skip


def host_syncs(step: Callable[[], None]) -> int:
    """How many times one step makes the host wait for the GPU (CUDA's sync debug mode counts
    each blocking call: .item(), a device-to-host copy, nonzero(), ...). Goal: 0."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def run(quick: bool = False, compile: bool = False, batch: int | None = None, device: str = "cuda") -> dict[str, Any]:
    if device == "cuda" and not torch.cuda.is_available():
        raise Unavailable(
            "needs a CUDA GPU (this machine has none). On a GPU machine run: "
            "python -m mpp.benchmarks gpu-step [--compile] --out runs/benchmarks/gpu-step.json"
        )
    cuda = device == "cuda"
    s = dict(SETTINGS["cpu" if not cuda else "quick" if quick else "full"])
    s["batch"] = batch or s["batch"]
    dev = torch.device(device)
    torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 parts (loss, optimiser) as a real run has them
    backends = ["sdpa"] + (["xformers"] if cuda and _xformers_ops()[0] is not None else [])
    mm, mm_best, mm_flops = matmul_roofline(MATMUL_N[device], dev, torch.bfloat16)
    rows = []
    for name in OBJECTIVES:
        for backend in backends:
            for compiled in [False, True] if compile else [False]:
                base = torch.cuda.memory_allocated(dev) if cuda else 0  # the matmul's buffers stay out of the peak
                model = build_contender(name, s, backend).to(dev)
                images = torch.randn(s["batch"], 3, *model.encoder.patch_embed.img_size, device=dev)
                step = make_step(name, torch.compile(model) if compiled else model, images,
                                 make_optimizer(model, name), autocast=torch.bfloat16)  # fmt: skip
                if cuda:
                    torch.cuda.reset_peak_memory_stats(dev)
                times = interleaved_times({"matmul": mm, "step": step}, s["rounds"], s["warmup"], dev)
                t = median(times["step"])
                flops = step_flops(model).step * s["batch"]
                rows.append({
                    "objective": name, "attention": backend, "compiled": compiled, "step_s": t,
                    "imgs_per_sec": s["batch"] / t, "tflops_per_s": flops / t / 1e12, "mfu": flops / t / PEAK_BF16,
                    "matmul_tflops_per_s": mm_flops / median(mm_best[-s["rounds"]:]) / 1e12,
                    "peak_mem_gib": (torch.cuda.max_memory_allocated(dev) - base) / 2**30 if cuda else None,
                    "host_syncs_per_step": host_syncs(step) if cuda else None,
                })  # fmt: skip
                del model, step
                if cuda:
                    torch.cuda.empty_cache()
    return {"setting": {**s, "device": device, "precision": "bf16 autocast", "peak_flops": PEAK_BF16},
            "rows": rows, "goals": goals(rows)}  # fmt: skip


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (attention, compiled): MPP and MAE MFU, HPM's step time ÷ MAE's, against GOALS."""
    out = []
    for key in sorted({(r["attention"], r["compiled"]) for r in rows}):
        by = {r["objective"]: r for r in rows if (r["attention"], r["compiled"]) == key}
        hpm_vs_mae = by["hpm"]["step_s"] / by["mae"]["step_s"]
        out.append({
            "attention": key[0], "compiled": key[1], "mpp_mfu": by["mpp"]["mfu"], "mae_mfu": by["mae"]["mfu"],
            "hpm_vs_mae_time": hpm_vs_mae,
            "met": by["mpp"]["mfu"] >= GOALS["mpp_mfu_min"] and by["mae"]["mfu"] >= GOALS["mae_mfu_min"]
            and hpm_vs_mae <= GOALS["hpm_vs_mae_time_max"],
        })  # fmt: skip
    return out


def render(result: dict[str, Any]) -> str:
    s = result["setting"]
    head = f"{s['model']} {s['overrides'] or ''} batch {s['batch']}, {s['precision']}, MFU vs {s['peak_flops'] / 1e12:.0f} TFLOP/s"
    goal_table = format_table(result["goals"], [
        ("attention", "attention", ""), ("compiled", "compile", ""), ("mpp_mfu", "MPP MFU (>= 0.40)", ".3f"),
        ("mae_mfu", "MAE MFU (>= 0.30)", ".3f"), ("hpm_vs_mae_time", "HPM ÷ MAE time (<= 2)", ".2f"), ("met", "met", ""),
    ])  # fmt: skip
    return head + "\n" + goal_table + "\n\n" + format_table(result["rows"], [
        ("objective", "objective", ""), ("attention", "attention", ""), ("compiled", "compile", ""),
        ("step_s", "s/step", ".4f"), ("imgs_per_sec", "img/s", ".0f"), ("tflops_per_s", "TFLOP/s", ".0f"),
        ("mfu", "MFU", ".3f"), ("matmul_tflops_per_s", "bf16 mm TFLOP/s", ".0f"), ("peak_mem_gib", "peak GiB", ".1f"),
        ("host_syncs_per_step", "host syncs/step", ""),
    ])  # fmt: skip
