"""gpu-step: ViT-B/16 training steps at 224 px in bf16 on one GPU: images/s and MFU for MPP,
MAE and HPM, xformers against SDPA attention, optionally under torch.compile.

MFU = model FLOP/s (mpp.benchmarks.flops) ÷ 790 TFLOP/s, the dense bf16 matmul throughput
measured on this project's H100/H200 (DESIGN.md §7). Recorded by hand on a GPU machine,
never in CI; on a machine without CUDA it refuses with exit code 2.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from mpp.benchmarks.common import Unavailable, format_table, interleaved_times, matmul_fn, median
from mpp.benchmarks.flops import step_flops
from mpp.benchmarks.step import build_contender, make_optimizer, make_step
from mpp.models.attention import _xformers_ops

PEAK_BF16 = 790e12
OBJECTIVES = ("mpp", "mae", "hpm")
SETTINGS = {
    "full": dict(model="vit_base_patch16_224", overrides={}, batch=128, decoder={}, rounds=10, warmup=3),
    "quick": dict(model="vit_base_patch16_224", overrides={"depth": 2}, batch=16,
                  decoder=dict(decoder_depth=1), rounds=3, warmup=2),
}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action="store_true", help="also time each objective under torch.compile")
    p.add_argument("--batch", type=int, help="images per step (default: the setting's)")


def run(quick: bool = False, compile: bool = False, batch: int | None = None) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise Unavailable(
            "needs a CUDA GPU (this machine has none). On a GPU machine run: "
            "python -m mpp.benchmarks gpu-step [--compile] --out runs/benchmarks/gpu-step.json"
        )
    s = dict(SETTINGS["quick" if quick else "full"])
    s["batch"] = batch or s["batch"]
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 parts (loss, optimiser) as a real run has them
    backends = ["sdpa"] + (["xformers"] if _xformers_ops()[0] is not None else [])
    images = torch.randn(s["batch"], 3, 224, 224, device=device)
    mm, mm_flops = matmul_fn(8192, device, torch.bfloat16)
    rows = []
    for name in OBJECTIVES:
        for backend in backends:
            for compiled in [False, True] if compile else [False]:
                base = torch.cuda.memory_allocated(device)  # the matmul's buffers stay out of the peak
                model = build_contender(name, s, backend).to(device)
                step = make_step(name, torch.compile(model) if compiled else model, images,
                                 make_optimizer(model, name, device), autocast=torch.bfloat16)  # fmt: skip
                torch.cuda.reset_peak_memory_stats(device)
                times = interleaved_times({"matmul": mm, "step": step}, s["rounds"], s["warmup"], device)
                t = median(times["step"])
                flops = step_flops(model).step * s["batch"]
                rows.append({
                    "objective": name, "attention": backend, "compiled": compiled, "step_s": t,
                    "imgs_per_sec": s["batch"] / t, "tflops_per_s": flops / t / 1e12, "mfu": flops / t / PEAK_BF16,
                    "matmul_tflops_per_s": mm_flops / median(times["matmul"]) / 1e12,
                    "peak_mem_gib": (torch.cuda.max_memory_allocated(device) - base) / 2**30,
                })  # fmt: skip
                del model, step
                torch.cuda.empty_cache()
    return {"setting": {**s, "precision": "bf16 autocast", "peak_flops": PEAK_BF16}, "rows": rows}


def render(result: dict[str, Any]) -> str:
    s = result["setting"]
    head = f"{s['model']} {s['overrides'] or ''} batch {s['batch']}, {s['precision']}, MFU vs {s['peak_flops'] / 1e12:.0f} TFLOP/s"
    return head + "\n" + format_table(result["rows"], [
        ("objective", "objective", ""), ("attention", "attention", ""), ("compiled", "compile", ""),
        ("step_s", "s/step", ".4f"), ("imgs_per_sec", "img/s", ".0f"), ("tflops_per_s", "TFLOP/s", ".0f"),
        ("mfu", "MFU", ".3f"), ("matmul_tflops_per_s", "bf16 mm TFLOP/s", ".0f"), ("peak_mem_gib", "peak GiB", ".1f"),
    ])  # fmt: skip
