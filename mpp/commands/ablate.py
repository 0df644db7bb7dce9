"""Masking ablation: a grid of overrides x seeds, each cell pretrained through the deepspeed
launcher and evaluated; results.csv, results.md (mean ± std over seeds) and results.png.

    python pretrain/ablate.py --base mpp_demo.json --grid masking.strategy=random,block,grid \\
        --grid objective.mask_ratio=0.5,0.75 --set train.max_steps=2000 --seeds 3 \\
        --eval finetune,linear,knn [--output-dir DIR] [--launcher-args --num_gpus 2]
    python pretrain/ablate.py --spec ablation.json [--output-dir DIR] [--set KEY=VALUE ...]
    python pretrain/ablate.py --spec ablation.json --submit slurm --nodes 1 --gpus-per-node 8 \
        --partition P --time 24:00:00      # each cell a job, its evaluations a dependent job
    python pretrain/ablate.py --status DIR  # each cell's state; results.* from what has finished

With fine-tuning among the evaluations, two baselines per seed are fine-tuned from scratch:
on their own recipe (--scratch-config, the fair comparison) and on the cells' (--baselines).

--set applies to every cell's pretraining, before the cell's grid values (a grid axis wins for
the same key); its model.* keys reach the evaluations too. Every cell is validated before
anything runs (exit 2 listing the bad cells); a rerun skips finished cells and resumes
half-done ones; a failed run is reported and the others go on (exit 1 at the end). With
--submit the command returns once the jobs are submitted (--wait: once they have ended);
submitting again submits only the cells that are neither done nor queued or running.
The command line's values replace the spec file's. --launcher-args takes the rest of the
command line.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from mpp.cli import add_submit_arguments
from mpp.config import ConfigError
from mpp.tools.ablation import AblationStopped, load_spec, run_ablation
from mpp.tools.ablation_report import write_report
from mpp.train.preemption import PREEMPTED_EXIT


def split_values(text: str) -> list[str]:
    """``random,block`` -> ["random", "block"]; commas inside [], {} or quotes stay (``[0.2,1.0],[0.5,1.0]``)."""
    values, depth, quote, current = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append(current)
            current = ""
            continue
        current += ch
    return [*values, current]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--spec",
        help="a JSON file: base, grid, set, seeds, eval, launcher_args, finetune_config, "
        "probe_config, output_dir (or out)",
    )
    p.add_argument("--base", help="the pretraining config: a JSON file or a name in configs/")
    p.add_argument(
        "--grid",
        action="append",
        metavar="KEY=V1,V2,...",
        help="one axis of the grid (repeat for more)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a key of every cell's pretraining config, value as JSON (repeatable); "
        "applied before the cell's grid values, so a grid axis wins for the same key "
        "(train.seed is always the run's seed)",
    )
    p.add_argument("--seeds", type=int, help="seeds per cell: 0..n-1 (default 1)")
    p.add_argument("--eval", help="comma-separated: finetune, linear, knn (default all three)")
    p.add_argument("--finetune-config", help="default finetune_demo")
    p.add_argument("--probe-config", help="linear probe and k-NN; default linear_demo")
    p.add_argument(
        "--baselines",
        help="comma-separated: scratch_own, scratch_same, or none "
        "(default both, when fine-tuning is evaluated)",
    )
    p.add_argument(
        "--scratch-config",
        help="fine-tuning from scratch on its own recipe; default finetune_scratch_demo",
    )
    p.add_argument(
        "--few-labels",
        type=int,
        metavar="K",
        help="also run every evaluation with K labelled images per class (knn@K, ...)",
    )
    p.add_argument(
        "--status",
        metavar="DIR",
        help="show each cell's state in an ablation's output folder and "
        "rebuild results.csv/md/png from what has finished",
    )
    p.add_argument(
        "--output-dir",
        "--out",
        dest="output_dir",
        help="the output folder (--out: the older name); default runs/ablation-<base name>",
    )
    p.add_argument(
        "--launcher-args",
        nargs=argparse.REMAINDER,
        help="the rest goes to deepspeed before the script (default: --num_gpus <GPUs>, or 2 CPU ranks)",
    )
    add_submit_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.status:
            return show_status(args.status)
        spec = load_spec(args.spec, cli_values(args))
        if args.submit:
            return submit(spec, args)
        started = time.perf_counter()
        rows, failed = run_ablation(spec)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except AblationStopped as e:
        print(f"stopped: {e}; the same command continues the ablation", file=sys.stderr)
        return PREEMPTED_EXIT
    for path in write_report(spec, rows, time.perf_counter() - started):
        print(f"wrote {path}")
    if failed:
        print(
            f"{failed} of {len(rows)} runs failed: see the logs listed in results.csv",
            file=sys.stderr,
        )
    return 1 if failed else 0


def cli_values(args: argparse.Namespace) -> dict:
    """The spec's keys given on the command line (None: not given)."""
    grid = None
    if args.grid:
        grid = {}
        for item in args.grid:
            if "=" not in item:
                raise ConfigError(f"--grid {item!r}: expected key=value1,value2,...")
            key, values = item.split("=", 1)
            grid[key.strip()] = split_values(values)
    # quoted: --launcher-args "--num_gpus 2"
    if args.launcher_args is not None and len(args.launcher_args) == 1:
        args.launcher_args = shlex.split(args.launcher_args[0])
    baselines = (
        None
        if args.baselines is None
        else [b for b in args.baselines.split(",") if b not in ("", "none")]
    )
    return {
        "base": args.base,
        "grid": grid,
        "set": args.set,
        "seeds": args.seeds,
        "output_dir": args.output_dir,
        "eval": args.eval.split(",") if args.eval else None,
        "launcher_args": args.launcher_args,
        "finetune_config": args.finetune_config,
        "probe_config": args.probe_config,
        "baselines": baselines,
        "scratch_config": args.scratch_config,
        "few_labels": args.few_labels,
    }


def submit(spec, args: argparse.Namespace) -> int:
    """Each cell a job (--submit), then with --wait the table once they have ended."""
    from mpp.submit import SubmitError, refused
    from mpp.tools.ablation_jobs import submit_ablation, wait_all

    try:
        submitted, _ = submit_ablation(spec, args)
    except (SubmitError, RuntimeError) as e:  # a flag that cannot work, or submitit's refusal
        return refused(e, args.submit)
    out = spec.out_dir
    print(
        f"{len(submitted)} submitted; pretrain/ablate.py --status {out} shows their state",
        flush=True,
    )
    if not args.wait:
        return 0
    wait_all(spec)
    return show_status(out)


def show_status(out_dir: str) -> int:
    """Each cell's state and the report from what has finished: 0 when all are done, 1 when
    some failed, 3 while some are still queued or running."""
    from mpp.tools.ablation_jobs import saved_spec, status_rows

    spec = saved_spec(Path(out_dir))
    rows, lines = status_rows(spec)
    width = max(len(label) for label, _, _ in lines)
    for label, state, detail in lines:
        print(f"{label:<{width}}  {state:<13} {detail}".rstrip())
    for path in write_report(spec, rows):
        print(f"wrote {path}")
    states = [state for _, state, _ in lines]
    counts = ", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states))
    print(f"{len(states)} runs: {counts}", flush=True)
    if any(s in ("queued", "running", "unknown") for s in states):
        return 3
    return 0 if all(s == "done" for s in states) else 1


if __name__ == "__main__":
    sys.exit(main())
