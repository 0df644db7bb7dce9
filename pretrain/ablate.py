"""Masking ablation: a grid of overrides x seeds, each cell pretrained through the deepspeed
launcher and evaluated; results.csv, results.md (mean ± std over seeds) and results.png.

    python pretrain/ablate.py --base mpp_demo.json --grid masking.strategy=random,block,grid \\
        --grid objective.mask_ratio=0.5,0.75 --set train.max_steps=2000 --seeds 3 \\
        --eval finetune,linear,knn [--output-dir DIR] [--launcher-args --num_gpus 2]
    python pretrain/ablate.py --spec ablation.json [--output-dir DIR] [--set KEY=VALUE ...]

--set applies to every cell's pretraining, before the cell's grid values (a grid axis wins for
the same key); its model.* keys reach the evaluations too. Every cell is validated before
anything runs (exit 2 listing the bad cells); a rerun skips finished cells and resumes
half-done ones; a failed run is reported and the others go on (exit 1 at the end).
The command line's values replace the spec file's. --launcher-args takes the rest of the
command line.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from mpp.ablation import AblationStopped, load_spec, run_ablation, split_values
from mpp.ablation_report import write_report
from mpp.config import ConfigError
from mpp.preemption import PREEMPTED_EXIT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", help="a JSON file: base, grid, set, seeds, eval, launcher_args, finetune_config, "
                   "probe_config, output_dir (or out)")
    p.add_argument("--base", help="the pretraining config: a JSON file or a name in configs/")
    p.add_argument("--grid", action="append", metavar="KEY=V1,V2,...", help="one axis of the grid (repeat for more)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a key of every cell's pretraining config, value as JSON (repeatable); "
                   "applied before the cell's grid values, so a grid axis wins for the same key "
                   "(train.seed is always the run's seed)")
    p.add_argument("--seeds", type=int, help="seeds per cell: 0..n-1 (default 1)")
    p.add_argument("--eval", help="comma-separated: finetune, linear, knn (default all three)")
    p.add_argument("--finetune-config", help="default finetune_demo")
    p.add_argument("--probe-config", help="linear probe and k-NN; default linear_demo")
    p.add_argument("--output-dir", "--out", dest="output_dir",
                   help="the output folder (--out: the older name); default runs/ablation-<base name>")
    p.add_argument("--launcher-args", nargs=argparse.REMAINDER,
                   help="the rest goes to deepspeed before the script (default: --num_gpus <GPUs>, or 2 CPU ranks)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        grid = None
        if args.grid:
            grid = {}
            for item in args.grid:
                if "=" not in item:
                    raise ConfigError(f"--grid {item!r}: expected key=value1,value2,...")
                key, values = item.split("=", 1)
                grid[key.strip()] = split_values(values)
        if args.launcher_args is not None and len(args.launcher_args) == 1:  # quoted: --launcher-args "--num_gpus 2"
            args.launcher_args = shlex.split(args.launcher_args[0])
        cli = {"base": args.base, "grid": grid, "set": args.set, "seeds": args.seeds, "output_dir": args.output_dir,
               "eval": args.eval.split(",") if args.eval else None,
               "launcher_args": args.launcher_args,
               "finetune_config": args.finetune_config, "probe_config": args.probe_config}
        spec = load_spec(args.spec, cli)
        rows, failed = run_ablation(spec)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except AblationStopped as e:
        print(f"stopped: {e}; the same command continues the ablation", file=sys.stderr)
        return PREEMPTED_EXIT
    for path in write_report(spec, rows):
        print(f"wrote {path}")
    if failed:
        print(f"{failed} of {len(rows)} runs failed: see the logs listed in results.csv", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
