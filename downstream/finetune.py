"""Fine-tune a pretrained encoder for classification under DeepSpeed.

    deepspeed downstream/finetune.py --config finetune_b16.json --set init=RUN_DIR|CKPT_DIR|FILE.safetensors|scratch
    python downstream/finetune.py --config finetune_demo.json --set init=runs/mpp_demo
"""

from __future__ import annotations

import json
import logging
import sys

from mpp.cli import config_from_args, open_run_dir, run_parser
from mpp.config import ConfigError, FinetuneConfig
from mpp.engine import device_type, init_distributed, plan_run, seed_everything, world_from_env
from mpp.finetune import build_classifier, run_finetune


def main(argv: list[str] | None = None) -> int:
    args = run_parser(__doc__, "finetune_b16, finetune_demo").parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rank, world = world_from_env()
    try:
        cfg = config_from_args(args, FinetuneConfig)
        seed_everything(cfg.train.seed)
        model = build_classifier(cfg)
        plan = plan_run(cfg, world, device_type(), model.encoder.patch_embed.img_size[0])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device = init_distributed()
    run_dir = open_run_dir(cfg, rank)
    results = run_finetune(cfg, model, plan, run_dir, device, resume=args.resume)
    if rank == 0:
        print(json.dumps({k: results[k] for k in ("top1", "top5", "epoch", "init")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
