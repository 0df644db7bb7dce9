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

from mpp.cli import config_from_args, run_parser
from mpp.commands.job import run_command
from mpp.config import FinetuneConfig
from mpp.jobs import finetune_model, run_finetune, start_of
from mpp.parallel.distributed import world_from_env
from mpp.submit import submit
from mpp.tools.plot import curves_at_end


def main(argv: list[str] | None = None) -> int:
    args = run_parser(__doc__, "finetune_b16, finetune_demo", submit=True).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rank = world_from_env()[0]
    if args.submit:  # checked here, run there: each task runs this command without --submit
        status, cfg = run_command(
            lambda: _checked(config_from_args(args, FinetuneConfig), args, rank), rank
        )
        return status or submit("mpp.commands.finetune", argv, cfg)
    status, done = run_command(
        lambda: run_finetune(config_from_args(args, FinetuneConfig), args.resume, args.restart),
        rank,
    )
    if status == 0 and rank == 0:
        print(f"curves: {curves_at_end(done.run_dir)}", file=sys.stderr)
        print(json.dumps({k: done.result[k] for k in ("top1", "top5", "epoch", "init")}))
    return status


def _checked(cfg, args, rank):
    """What a submission checks of the run before the job exists (not the data)."""
    finetune_model(cfg)
    start_of(cfg, args.resume, args.restart, rank)
    return cfg


if __name__ == "__main__":
    sys.exit(main())
