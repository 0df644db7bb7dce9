"""Fine-tune a pretrained encoder for classification under DeepSpeed.

    deepspeed downstream/finetune.py --config finetune_b16.json --set init=RUN_DIR|CKPT_DIR|FILE.safetensors|scratch
    python downstream/finetune.py --config finetune_demo.json --set init=runs/mpp_demo
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from mpp.config import ConfigError, FinetuneConfig, load_config, save_config
from mpp.engine import device_type, init_distributed, plan_run, seed_everything, world_from_env
from mpp.finetune import build_classifier, run_finetune


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a JSON file, or a name in configs/ (finetune_b16, finetune_demo)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key, value as JSON")
    p.add_argument("--output-dir", help="the run directory (default: train.output_dir)")
    p.add_argument("--resume", help="'auto' or a checkpoint path")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rank, world = world_from_env()
    try:
        overrides = args.set + ([f"train.output_dir={args.output_dir}"] if args.output_dir else [])
        cfg = load_config(args.config, overrides, cls=FinetuneConfig)
        seed_everything(cfg.train.seed)
        model = build_classifier(cfg)
        plan = plan_run(cfg, world, device_type(), model.encoder.patch_embed.img_size[0])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.train.output_dir.format(name=cfg.name))
    device = init_distributed()
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.json")
    results = run_finetune(cfg, model, plan, run_dir, device, resume=args.resume)
    if rank == 0:
        print(json.dumps({k: results[k] for k in ("top1", "top5", "epoch", "init")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
