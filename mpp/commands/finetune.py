"""Fine-tune a pretrained encoder for classification under DeepSpeed.

mpp finetune --config finetune_demo --set init=runs/mpp_demo      # one process
deepspeed --num_gpus 8 --module mpp.commands.finetune --config finetune_b16 --set init=RUN_DIR|CKPT_DIR|FILE.safetensors|scratch
mpp finetune --config finetune_b16 --set init=RUN_DIR --submit slurm --gpus-per-node 8 --time 24:00:00
(from a clone: deepspeed downstream/finetune.py --config finetune_b16 ...)

The same command run again goes on from the run directory's newest complete checkpoint;
--restart starts over (the earlier run is moved aside, not deleted).
"""

from __future__ import annotations

import json
import logging
import sys

from mpp.cli import config_from_args, open_run_dir, resume_of, run_parser
from mpp.commands.job import finish
from mpp.config import ConfigError, FinetuneConfig
from mpp.parallel.distributed import (
    PortInUse,
    device_type,
    from_rank0,
    init_distributed,
    world_from_env,
)
from mpp.submit import submit
from mpp.tools.plot import curves_at_end
from mpp.train.plan import check_data, plan_run
from mpp.train.rng import seed_everything
from mpp.transfer.finetune import build_classifier, run_finetune


def main(argv: list[str] | None = None) -> int:
    args = run_parser(__doc__, "finetune_b16, finetune_demo", submit=True).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rank, world = world_from_env()
    try:
        cfg = config_from_args(args, FinetuneConfig)
        seed_everything(cfg.train.seed)
        model = build_classifier(cfg)
        resume = resume_of(cfg, args, rank)  # checked against the checkpoint (check_resume)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # checked here, run there: each task runs this command without --submit (mpp.submit)
    if args.submit:
        return submit("mpp.commands.finetune", argv, cfg)
    try:  # what the data lets us check before DeepSpeed's first-use build (not at submission:
        # the shards may be visible on the compute nodes only)
        check_data(cfg, model.encoder.patch_embed.img_size[0])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        device = init_distributed()
        # the shards' samples counted by the ranks together (mpp.data.census); rank 0's plan on
        # every rank
        img_size = model.encoder.patch_embed.img_size[0]
        plan = from_rank0(
            plan_run(cfg, world, device_type(), img_size, num_classes=model.num_classes)
        )
        run_dir = open_run_dir(
            cfg, rank, restart=args.restart
        )  # held by this job: a second one on it stops here
    except (ConfigError, PortInUse) as e:  # the same on every rank: said once
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    status, results = finish(
        lambda: run_finetune(cfg, model, plan, run_dir, device, resume=resume), run_dir, rank
    )
    if status:
        return status
    if rank == 0:
        print(f"curves: {curves_at_end(run_dir)}", file=sys.stderr)
        print(json.dumps({k: results[k] for k in ("top1", "top5", "epoch", "init")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
