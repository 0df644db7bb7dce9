"""gpu-step: the real training step of MPP, MAE and HPM (ViT-B/16, 224 px) on one GPU:
DeepSpeed's engine as the shipped configs set it (ZeRO stage 0, bf16 autocast, mpp's multi-tensor
gradient path), images/s, MFU against the GPU's spec-sheet peak, peak memory, host syncs and
kernels per step; xformers against SDPA; optionally under torch.compile (``--compile``) and under
issue 36's other levers (``--levers``: DeepSpeed's ZeRO-1 bf16 path as mpp now sets it, and as it
ran before).

Each row is ``mpp.tools.doctor.engine_step`` on ``step_config``: the objective from
configs/{objective}_b16.json at the setting's batch on one rank, stepped as mpp.train.trainer steps it, in the precision the
recipe takes on a GPU (TF32 off, as training leaves it). MFU = model FLOPs (mpp.tools.flops)
÷ the dense bf16 peak of the GPU's datasheet (mpp.tools.planner.hardware.SPEC_BF16_DENSE: H100 SXM 989 TFLOP/s),
never a figure measured here; the bf16 matmul it measures is its own column. Recorded by hand on
a GPU machine, never in CI; without CUDA it refuses with exit code 2 (--device cpu runs the same
code on a tiny model, MFU then against this CPU's measured bf16 matmul: a check, not a figure).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from typing import Any

import torch

from benchmarks.common import Unavailable, format_table, matmul_roofline, median
from mpp.config import Config, load_config
from mpp.models.attention import xformers_refusal
from mpp.tools.doctor.engine_step import EngineStep, measure
from mpp.tools.planner.hardware import spec_peak

GOALS = {"mpp_mfu_min": 0.40, "mae_mfu_min": 0.30, "hpm_vs_mae_time_max": 2.0}
OBJECTIVES = ("mpp", "mae", "hpm")
# the head widths of every setting: the encoders' (ViT-B 768 / 12, ViT-Ti 192 / 3) and MAE's
# and HPM's decoders' (512 / 16, the tiny ones' 64 / 4 ... 16)
HEAD_DIMS = (64, 32, 16)
SETTINGS = {
    "full": dict(
        model="vit_base_patch16_224", overrides={}, batch=128, decoder={}, rounds=10, warmup=3
    ),
    "quick": dict(
        model="vit_base_patch16_224",
        overrides={"depth": 2},
        batch=16,
        decoder=dict(decoder_depth=1),
        rounds=3,
        warmup=2,
    ),
    # --device cpu: the same code on a tiny model, to check the suite runs (not a figure)
    "cpu": dict(
        model="vit_tiny_patch16_64",
        overrides={"depth": 2},
        batch=4,
        decoder=dict(decoder_dim=64, decoder_depth=1, decoder_heads=4),
        rounds=2,
        warmup=1,
    ),
}
MATMUL_N = {"cuda": 8192, "cpu": 256}
# issue 36 §2's levers, each a row's config overrides beside the recipe as shipped (ZeRO stage 0,
# bf16 autocast, mpp's multi-tensor gradient path): DeepSpeed's ZeRO-1 bf16 path with the
# per-tensor work mpp now turns off, and as it ran before (its overflow check, a gradient norm,
# and DeepSpeed's default clip at 1.0, which MAE and HPM used to get)
LEVERS = {
    "shipped": [],
    "zero1-bf16": ["deepspeed.zero_optimization.stage=1", "train.precision=bf16"],
    "zero1-bf16-before": [
        "deepspeed.zero_optimization.stage=1",
        "train.precision=bf16",
        'deepspeed.bf16={"check_grad_overflow": true}',
        "deepspeed.zero_optimization.compute_grad_norm=true",
        "optim.grad_clip=1.0",
    ],
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile", action="store_true", help="also time each objective under torch.compile"
    )
    p.add_argument("--batch", type=int, help="images per step (default: the setting's)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every row, as pretraining takes it "
        "(e.g. deepspeed.zero_optimization.stage=0 or train.skip_nonfinite=false)",
    )
    p.add_argument(
        "--objectives",
        default=",".join(OBJECTIVES),
        help="comma-separated, of mpp,mae,hpm (the goals need all three)",
    )
    p.add_argument(
        "--levers",
        action="store_true",
        help="also each row under the other levers: " + ", ".join(LEVERS),
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also split each row's GPU time by kernel kind (torch.profiler): matmul, attention, "
        "elementwise, optimizer, and idle",
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: run the suite's code on a tiny model to check it works (no figures)",
    )


# validated by the config, never read: the step's images are made on the device
DUMMY_SHARDS = "unused-{000000..000000}.tar"


def step_config(
    objective: str, setting: dict, attn_backend: str = "auto", precision: str = "as on a GPU"
) -> Config:
    """``configs/{objective}_b16.json`` at the setting's model, decoder and batch, one rank, micro
    batch = batch (no accumulation), everything else (optimiser, ZeRO stage) as shipped; the
    precision the recipe takes on a GPU (its ``auto`` resolved for CUDA) on any device, unless
    given or set (``setting["sets"]`` win over everything)."""
    if precision == "as on a GPU":
        cfg = step_config(objective, setting, attn_backend, "auto")
        precision = cfg.resolved_precision("cuda")
    overrides = {
        "model.name": setting["model"],
        "model.attn_backend": attn_backend,
        **{f"model.{k}": v for k, v in setting["overrides"].items()},
        **(
            {f"objective.{k}": v for k, v in setting["decoder"].items()}
            if objective != "mpp"
            else {}
        ),
        # the decoders too (MAE's, HPM's predictor): a row's attention is the whole step's
        **({"objective.attn_backend": attn_backend} if objective != "mpp" else {}),
        "train.batch_size": setting["batch"],
        "train.max_micro_batch_size": None,
        "train.max_steps": 1,
        "train.precision": precision,
        "data.train_shards": DUMMY_SHARDS,
    }
    # the setting's own overrides (gpu-step --set) last: they win
    sets = [f"{k}={json.dumps(v)}" for k, v in overrides.items()] + setting.get("sets", [])
    return load_config(f"{objective}_b16", sets)


# a CUDA kernel's kind, by its name, first match (cuBLAS's Hopper GEMMs are nvjet/sm90 xmma; SDPA's flash and
# efficient kernels; torch's fused AdamW is multi_tensor/foreach); anything else is elementwise work
KERNEL_KINDS = (
    ("attention", re.compile(r"flash|fmha|attention", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|xmma|wgmma|cutlass|cublas", re.I)),
    ("optimizer", re.compile(r"multi_tensor|foreach|adam", re.I)),
    ("communication", re.compile(r"nccl", re.I)),
)


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "elementwise")


def kernel_shares(runner: EngineStep, steps: int = 3) -> tuple[dict[str, float], float]:
    """Where ``steps`` steps spend the GPU's time, from torch.profiler's kernel records: each kind's
    share of the wall time, and ``idle`` (the GPU running no kernel: the host is the limit); and
    the kernels launched per step."""
    from torch.profiler import ProfilerActivity, profile

    runner.step()
    torch.cuda.synchronize(runner.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            runner.step()
        torch.cuda.synchronize(runner.device)
        wall_us = (time.perf_counter() - start) * 1e6
    busy: Counter = Counter()
    kernels = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            busy[kernel_kind(e.name)] += e.device_time_total
            kernels += 1
    shares = {kind: round(us / wall_us, 3) for kind, us in busy.most_common()}
    shares["idle"] = round(max(0.0, 1 - sum(busy.values()) / wall_us), 3)
    return shares, kernels / steps


def run(
    quick: bool = False,
    compile: bool = False,
    batch: int | None = None,
    device: str = "cuda",
    profile: bool = False,
    sets: list[str] | None = None,
    levers: bool = False,
    objectives: str = ",".join(OBJECTIVES),
) -> dict[str, Any]:
    from mpp.parallel.distributed import init_distributed

    if device == "cuda" and not torch.cuda.is_available():
        raise Unavailable(
            "needs a CUDA GPU (this machine has none). On a GPU machine run: "
            "python -m benchmarks gpu-step [--compile] --out runs/benchmarks/gpu-step.json"
        )
    cuda = device == "cuda"
    s = dict(SETTINGS["cpu" if not cuda else "quick" if quick else "full"])
    s["batch"], s["profile"], s["sets"] = batch or s["batch"], profile, sets or []
    # deepspeed.initialize needs a process group: this process is rank 0 of 1
    dev = init_distributed()
    if cuda:
        peak, source = spec_peak(torch.cuda.get_device_name(dev))
    else:  # no datasheet for a CPU: each row's MFU is against this CPU's bf16 matmul, timed beside it
        peak = None
        source = (
            f"measured: this CPU's bf16 {MATMUL_N['cpu']}^3 matmul (a code check, not a figure)"
        )
    # an importable xformers may still have no kernel (a wheel built for another torch)
    refused = (
        next(filter(None, (xformers_refusal(torch.bfloat16, d, dev) for d in HEAD_DIMS)), "")
        if cuda
        else "no CUDA"
    )
    backends = ["sdpa"] + ([] if refused else ["xformers"])
    matmul = matmul_roofline(MATMUL_N[device], dev, torch.bfloat16)
    rows = []
    for lever in LEVERS if levers else ["shipped"]:
        setting = {**s, "sets": [*LEVERS[lever], *s["sets"]]}
        for name in [o for o in objectives.split(",") if o]:
            for backend in backends:
                for compiled in [False, True] if compile else [False]:
                    try:
                        row = measure_row(name, backend, compiled, setting, dev, matmul, peak)
                    except Exception as e:  # one lever that fails on this machine: the rest stand
                        row = {"objective": name, "attention": backend, "compiled": compiled}
                        row["error"] = f"{e.__class__.__name__}: {e}"[:500]
                    rows.append({"lever": lever, **row})
    setting = {
        **s,
        "device": device,
        "precision": rows[0].get("precision"),
        "zero_stage": rows[0].get("zero_stage"),
        "peak_flops": peak,
        "peak_source": source,
        "tf32": torch.backends.cuda.matmul.allow_tf32,
        "xformers": refused or "ran",
    }
    return {"setting": setting, "rows": rows, "goals": goals(rows)}


def measure_row(
    name: str,
    backend: str,
    compiled: bool,
    s: dict,
    dev: torch.device,
    matmul: tuple,
    peak: float | None,
) -> dict[str, Any]:
    """One objective x attention x compile: built, timed through DeepSpeed's engine, released."""
    cuda = dev.type == "cuda"
    # the matmul's buffers stay out of the peak
    base = torch.cuda.memory_allocated(dev) if cuda else 0
    # bf16 on the CPU as well: the check runs DeepSpeed's bf16 path that the GPU runs
    runner = EngineStep(step_config(name, s, backend), dev, compile=compiled)
    try:
        row = measure(runner, s["rounds"], s["warmup"], beside=matmul[0])
        row["matmul_tflops_per_s"] = matmul[2] / median(matmul[1][-s["rounds"] :]) / 1e12
        if cuda and s["profile"]:
            row["gpu_time"], row["kernels_per_step"] = kernel_shares(runner)
    finally:
        runner.close()
    if cuda:
        row["peak_mem_gib"] -= base / 2**30
    flops_per_s = row["tflops_per_s"] * 1e12
    denominator = peak if cuda else row["matmul_tflops_per_s"] * 1e12
    row["mfu"] = flops_per_s / denominator if denominator else None
    return {"objective": name, "attention": backend, "compiled": compiled, **row}


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (lever, attention, compiled): MPP and MAE MFU, HPM's step time ÷ MAE's, against GOALS."""
    out = []
    keys = dict.fromkeys((r.get("lever", "shipped"), r["attention"], r["compiled"]) for r in rows)
    for key in keys:
        by = {
            r["objective"]: r
            for r in rows
            if (r.get("lever", "shipped"), r["attention"], r["compiled"]) == key
            and "error" not in r
        }
        if set(by) != set(OBJECTIVES):
            continue  # a row failed: its error is in the rows
        hpm_vs_mae = by["hpm"]["step_s"] / by["mae"]["step_s"]
        mfu_met = None not in (by["mpp"]["mfu"], by["mae"]["mfu"]) and (
            by["mpp"]["mfu"] >= GOALS["mpp_mfu_min"] and by["mae"]["mfu"] >= GOALS["mae_mfu_min"]
        )
        out.append(
            {
                "lever": key[0],
                "attention": key[1],
                "compiled": key[2],
                "mpp_mfu": by["mpp"]["mfu"],
                "mae_mfu": by["mae"]["mfu"],
                "hpm_vs_mae_time": hpm_vs_mae,
                "met": mfu_met and hpm_vs_mae <= GOALS["hpm_vs_mae_time_max"],
            }
        )
    return out


def render(result: dict[str, Any]) -> str:
    s = result["setting"]
    head = (
        f"{s['model']} {s['overrides'] or ''} {' '.join(s.get('sets', []))} batch {s['batch']}, "
        f"DeepSpeed {s['precision']}, ZeRO stage "
        f"{s['zero_stage']}, TF32 {'on' if s['tf32'] else 'off'}; MFU peak: {s['peak_source']}"
    )
    goal_table = format_table(
        result["goals"],
        [
            ("lever", "lever", ""),
            ("attention", "attention", ""),
            ("compiled", "compile", ""),
            ("mpp_mfu", "MPP MFU (>= 0.40)", ".3f"),
            ("mae_mfu", "MAE MFU (>= 0.30)", ".3f"),
            ("hpm_vs_mae_time", "HPM ÷ MAE time (<= 2)", ".2f"),
            ("met", "met", ""),
        ],
    )
    return (
        head
        + "\n"
        + goal_table
        + "\n\n"
        + format_table(
            result["rows"],
            [
                ("lever", "lever", ""),
                ("objective", "objective", ""),
                ("attention", "attention", ""),
                ("compiled", "compile", ""),
                ("precision", "precision", ""),
                ("zero_stage", "ZeRO", ""),
                ("step_s", "s/step", ".4f"),
                ("imgs_per_sec", "img/s", ".0f"),
                ("tflops_per_s", "TFLOP/s", ".0f"),
                ("mfu", "MFU", ".3f"),
                ("matmul_tflops_per_s", "bf16 mm TFLOP/s", ".0f"),
                ("peak_mem_gib", "peak GiB", ".1f"),
                ("host_syncs_per_step", "host syncs/step", ""),
                ("kernels_per_step", "kernels/step", ".0f"),
                ("error", "error", ""),
            ],
        )
        + profile_table(result["rows"])
    )


def profile_table(rows: list[dict[str, Any]]) -> str:
    """``--profile``: each row's GPU time by kernel kind, as shares of the step's wall time."""
    rows = [r for r in rows if r.get("gpu_time")]
    if not rows:
        return ""
    kinds = ["matmul", "attention", "elementwise", "optimizer", "communication", "idle"]
    table = [
        {
            "row": f"{r.get('lever', 'shipped')} {r['objective']} {r['attention']}"
            + (" compiled" if r["compiled"] else "")
        }
        | {k: r["gpu_time"].get(k, 0.0) for k in kinds}
        for r in rows
    ]
    return "\n\nshare of the step's wall time (torch.profiler kernels)\n" + format_table(
        table, [("row", "row", "")] + [(k, k, ".3f") for k in kinds]
    )
