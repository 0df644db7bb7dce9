"""The planning table of BENCHMARKS.md: ViT-B/L/H x MPP/MAE/HPM x ZeRO 1/2/3 on 8 and 64 GPUs.

    python -m benchmarks.plan_table [--gpu h100] [--out plan-table.md]

One fake step per model and objective (``mpp.tools.planner.fake_step``; its measurements do not depend on the
ZeRO stage or the GPU count), then ``mpp.tools.planner.report.plan_gpus`` for every stage and count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mpp.tools.measure import format_table
from mpp.tools.planner.fake_step import measure
from mpp.tools.planner.hardware import GPUS, gpu
from mpp.tools.planner.report import plan_gpus
from mpp.train.plan import load_plan_config

MODELS = {
    "ViT-B/16": "vit_base_patch16_224",
    "ViT-L/16": "vit_large_patch16_224",
    "ViT-H/14": "vit_huge_patch14_224",
}
OBJECTIVES = ("mpp", "mae", "hpm")
STAGES = (1, 2, 3)
GPU_COUNTS = (8, 64)
COLUMNS = [
    ("model", "model", ""),
    ("objective", "objective", ""),
    ("gpus", "GPUs", "d"),
    ("stage", "ZeRO", "d"),
    ("micro", "micro x accum", ""),
    ("peak_gib", "peak GiB", ".1f"),
    ("activations_gib", "activations", ".1f"),
    ("model_states_gib", "model states", ".1f"),
    ("fits", "fits", ""),
    ("max_micro_batch", "largest micro", "d"),
    ("needs_grad_checkpointing", "needs ckpt", ""),
    ("compute_ms", "compute ms", ".0f"),
    ("hbm_ms", "HBM ms", ".0f"),
    ("roofline_ms", "roofline ms", ".0f"),
    ("comm_ms", "comm ms", ".0f"),
    ("mfu_ceiling", "MFU ceiling", ".2f"),
    ("comm_gb", "comm GB/step", ".2f"),
]


def rows_for(model: str, objective: str, spec: Any) -> list[dict[str, Any]]:
    """Every stage and GPU count of one model and objective, from one fake step."""
    config, base = f"{objective}_b16", [f"model.name={MODELS[model]}"]
    measured = measure(config, base, [64, 128], "bf16")

    def measured_for(extra: list[str], micro: list[int]) -> dict[str, Any]:
        return measure(config, [*base, *extra], [64, 128], "bf16") if extra else measured

    rows = []
    for gpus in GPU_COUNTS:
        for stage in STAGES:
            cfg, known = load_plan_config(
                config, [*base, f"deepspeed.zero_optimization.stage={stage}"]
            )
            plan = plan_gpus(cfg, known, gpus, spec, measured_for)
            s, r = plan["step_time_s"], plan["recipe"]
            rows.append(
                {
                    **plan,
                    "model": model,
                    "objective": objective.upper(),
                    "stage": stage,
                    "micro": f"{r['micro_batch']} x {r['grad_accum']}",
                    "compute_ms": 1e3 * s["compute_s"],
                    "hbm_ms": 1e3 * s["memory_s"],
                    "roofline_ms": 1e3 * s["roofline_s"],
                    "comm_ms": 1e3 * s["comm_s"],
                    "comm_gb": plan["comm_bytes_per_step"] / 1e9,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plan_table", description=__doc__)
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    p.add_argument("--out", help="also write the table here")
    args = p.parse_args(argv)
    spec = gpu(args.gpu)
    rows = [
        row
        for model in MODELS
        for objective in OBJECTIVES
        for row in rows_for(model, objective, spec)
    ]
    table = format_table(rows, COLUMNS)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
