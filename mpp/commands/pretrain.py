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

import logging
import sys

from mpp.cli import config_from_args, run_parser
from mpp.commands.job import ending, run_command
from mpp.jobs import pretrain_objective, run_pretrain, start_of
from mpp.parallel.distributed import world_from_env
from mpp.submit import submit
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rank = world_from_env()[0]
    if args.submit:  # checked here, run there: each task runs this command without --submit
        status, cfg = run_command(lambda: _checked(config_from_args(args), args, rank), rank)
        return status or submit("mpp.commands.pretrain", argv, cfg)
    status, done = run_command(
        lambda: run_pretrain(config_from_args(args), args.resume, args.restart), rank
    )
    if status == 0 and rank == 0:
        print(ending(done.result, done.run_dir, done.seconds, "encoder.safetensors"))
    return status


def _checked(cfg, args, rank):
    """What a submission checks of the run before the job exists (not the data: the shards may be
    visible on the compute nodes only)."""
    pretrain_objective(cfg)
    start_of(cfg, args.resume, args.restart, rank)
    return cfg


if __name__ == "__main__":
    sys.exit(main())
