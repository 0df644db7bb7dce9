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
import time

from mpp.build import build_objective
from mpp.cli import config_from_args, open_run_dir, resume_of, run_parser
from mpp.commands.job import ending, finish
from mpp.config import ConfigError
from mpp.parallel.distributed import (
    PortInUse,
    device_type,
    from_rank0,
    init_distributed,
    world_from_env,
)
from mpp.submit import submit
from mpp.tools.planner.cli import add_plan_arguments, plan_main
from mpp.train.plan import check_data, plan_run
from mpp.train.rng import seed_everything
from mpp.train.trainer import Trainer


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
    rank, world = world_from_env()
    try:  # every check before the run directory exists
        cfg = config_from_args(args)
        seed_everything(cfg.train.seed)  # the same initial weights on every rank and every run
        objective = build_objective(cfg)
        resume = resume_of(cfg, args, rank)  # checked against the checkpoint (check_resume)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # checked here, run there: each task runs this command without --submit (mpp.submit)
    if args.submit:
        return submit("mpp.commands.pretrain", argv, cfg)
    try:  # what the data lets us check before DeepSpeed's first-use build (not at submission:
        # the shards may be visible on the compute nodes only)
        check_data(cfg, objective.encoder.patch_embed.img_size[0])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        device = init_distributed()
        # the shards' samples counted by the ranks together (mpp.data.census); rank 0's plan on
        # every rank
        plan = from_rank0(
            plan_run(cfg, world, device_type(), objective.encoder.patch_embed.img_size[0])
        )
        # data.mean / std "auto": measured with the plan (mpp.data.stats), now known
        objective.set_pixel_stats(cfg.data.mean, cfg.data.std)
        run_dir = open_run_dir(
            cfg, rank, restart=args.restart
        )  # held by this job: a second one on it stops here
    except (ConfigError, PortInUse) as e:  # the same on every rank: said once
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    status, state = finish(
        lambda: Trainer(cfg, objective, plan, run_dir, device, resume=resume).train(),
        run_dir,
        rank,
    )
    if status:
        return status
    if rank == 0:
        print(ending(state, run_dir, time.perf_counter() - start, "encoder.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
