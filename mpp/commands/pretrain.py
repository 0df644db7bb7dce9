"""Pretrain a ViT with a masked-patch objective under DeepSpeed.

deepspeed pretrain/run.py --config mpp_b16.json [--set key=value ...] [--output-dir DIR] [--resume auto|PATH]
python pretrain/run.py --config mpp_demo.json          # one process
python pretrain/run.py --config mpp_b16.json --plan --gpus 64   # the GPU plan (mpp plan): nothing runs
python pretrain/run.py --config mpp_b16.json --submit slurm --nodes 8 --gpus-per-node 8 --partition P --time 72:00:00
"""

from __future__ import annotations

import logging
import sys

from mpp.build import build_objective
from mpp.cli import config_from_args, open_run_dir, run_parser
from mpp.commands.job import finish
from mpp.config import ConfigError
from mpp.parallel.distributed import device_type, from_rank0, init_distributed, world_from_env
from mpp.submit import submit
from mpp.tools.planner.cli import add_plan_arguments, plan_main
from mpp.train.plan import check_resume, plan_run
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
        check_resume(cfg, args.resume)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # checked here, run there: each task runs this command without --submit (mpp.submit)
    if args.submit:
        return submit("mpp.commands.pretrain", argv, cfg)
    device = init_distributed()
    try:  # the shards' samples counted by the ranks together (mpp.data.census); rank 0's plan on every rank
        plan = from_rank0(
            plan_run(cfg, world, device_type(), objective.encoder.patch_embed.img_size[0])
        )
        # data.mean / std "auto": measured with the plan (mpp.data.stats), now known
        objective.set_pixel_stats(cfg.data.mean, cfg.data.std)
        run_dir = open_run_dir(cfg, rank)  # held by this job: a second one on it stops here
    except ConfigError as e:  # the same on every rank: said once
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    status, state = finish(
        lambda: Trainer(cfg, objective, plan, run_dir, device, resume=args.resume).train(),
        run_dir,
        rank,
    )
    if status:
        return status
    if rank == 0:
        print(
            f"done: {state.step} steps, {state.samples} images -> {run_dir}/metrics.jsonl, "
            f"{run_dir}/checkpoints, {run_dir}/encoder.safetensors"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
