"""The planner's command line, shared by ``python -m mpp.tools.planner`` and ``pretrain/run.py --plan``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mpp.config import ConfigError
from mpp.tools.planner.hardware import GPUS, gpu


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """--gpus, --gpu, --out (shared with pretrain/run.py --plan)."""
    p.add_argument("--gpus", type=int, default=8, help="GPUs (ranks) in the run (default 8)")
    p.add_argument(
        "--gpu", choices=sorted(GPUS), default="h100", help="the GPU's spec sheet (default h100)"
    )
    p.add_argument("--out", help="write the plan as JSON here")


def plan_main(config: str, overrides: list[str], gpus: int, kind: str, out: str | None) -> int:
    """Print the plan (and write it to ``out``); 2 with one error line when it cannot be made."""
    from mpp.tools.planner.fake_step import measure
    from mpp.tools.planner.report import plan_gpus, render
    from mpp.train.plan import load_plan_config

    try:
        if gpus < 1:
            raise ConfigError(f"--gpus {gpus}: must be at least 1")
        cfg, data_known = load_plan_config(config, overrides)
        dtype = cfg.resolved_precision("cuda")

        def measure_config(extra: list[str], micro: list[int]) -> dict:
            return measure(config, [*overrides, *extra], micro, dtype)

        plan = plan_gpus(cfg, data_known, gpus, gpu(kind), measure_config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(plan))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(plan, indent=1) + "\n")
    return 0
