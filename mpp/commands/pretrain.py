"""Pretrain a ViT with a masked-patch objective under DeepSpeed.

mpp pretrain --config mpp_demo                          # one process, the built-in digits
mpp pretrain --config mae_demo --output-dir runs/mine --set model.img_size=64 --set data.train_shards="data/mine/train-{000000..000003}.tar"
    (your shards, from mpp shards, at 64 px)
deepspeed --num_gpus 8 --module mpp.commands.pretrain --config mae_b16 [--set key=value ...]
mpp pretrain --config mae_b16 --plan --gpus 64          # the GPU plan (mpp plan): nothing runs
mpp pretrain --config mae_b16 --submit slurm --nodes 8 --gpus-per-node 8 --partition P --time 72:00:00
(from a clone: deepspeed pretrain/run.py --config mae_b16 ...)

The same command run again goes on from the run directory's newest complete checkpoint;
--restart starts over (the earlier run is moved aside, not deleted).
"""

from __future__ import annotations

import sys

from mpp.cli import run_parser
from mpp.commands.job import own_part, train_main
from mpp.config import Config
from mpp.jobs import run_pretrain
from mpp.tools.planner.cli import add_plan_arguments, plan_main


def main(argv: list[str] | None = None) -> int:
    parser = run_parser(__doc__, "mpp_b16, mpp_demo, ...", submit=True)
    parser.add_argument(
        "--plan", action="store_true", help="print the GPU plan (mpp plan) and exit"
    )
    add_plan_arguments(parser.add_argument_group("--plan"))
    args = parser.parse_args(argv)
    if args.plan:  # nothing created: no process group, no run directory
        return plan_main(args.config, args.set, args.gpus, args.gpu, args.out)
    return train_main(args, argv, "mpp.commands.pretrain", Config, run_pretrain, _report)


def _report(done) -> None:
    """The line a run ends with: this command's steps, images, time and img/s (``own_part``), the
    last figures, and where it all is (its curves drawn: ``mpp plot``)."""
    from mpp.tools.plot import curves_at_end
    from mpp.train.metrics import last_figures

    run_dir = done.run_dir
    figures = last_figures(run_dir)
    print(
        f"done: {own_part(done)}"
        + (f"; {figures}" if figures else "")
        + f" -> {run_dir}: metrics.jsonl, {curves_at_end(run_dir)}, checkpoints/, "
        "encoder.safetensors"
    )


if __name__ == "__main__":
    sys.exit(main())
