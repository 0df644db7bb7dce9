"""Pretrain a ViT with a masked-patch objective under DeepSpeed.

    deepspeed pretrain/run.py --config mpp_b16.json [--set key=value ...] [--output-dir DIR] [--resume auto|PATH]
    python pretrain/run.py --config mpp_demo.json          # one process
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from mpp.build import build_objective
from mpp.config import ConfigError, load_config, save_config
from mpp.data import DataError
from mpp.engine import (
    NonFiniteLossError,
    device_type,
    init_distributed,
    plan_run,
    seed_everything,
    train,
    world_from_env,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a JSON file, or a name in configs/ (mpp_b16, mpp_demo, ...)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key, value as JSON")
    p.add_argument("--output-dir", help="the run directory (default: train.output_dir)")
    p.add_argument("--resume", help="'auto' (newest complete checkpoint of this run) or a checkpoint path")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)  # the launcher's
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rank, world = world_from_env()
    try:  # every check before the run directory exists
        overrides = args.set + ([f"train.output_dir={args.output_dir}"] if args.output_dir else [])
        cfg = load_config(args.config, overrides)
        seed_everything(cfg.train.seed)  # the same initial weights on every rank and every run
        objective = build_objective(cfg)
        plan = plan_run(cfg, world, device_type(), objective.encoder.patch_embed.img_size[0])
        if args.resume not in (None, "auto") and not Path(args.resume).exists():
            raise ConfigError(f"--resume {args.resume}: no such checkpoint")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.train.output_dir.format(name=cfg.name))
    device = init_distributed()
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.json")
    model_kwargs = {"name": cfg.model.name, **cfg.model.vit_kwargs()}
    try:
        state = train(cfg, objective, plan, run_dir, device, resume=args.resume, model_kwargs=model_kwargs)
    except (NonFiniteLossError, DataError) as e:  # DataLoader workers wrap the message in a traceback
        print(f"error: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    if rank == 0:
        print(f"done: {state.step} steps, {state.samples} images -> {run_dir}/metrics.jsonl, "
              f"{run_dir}/checkpoints, {run_dir}/encoder.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
