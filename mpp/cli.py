"""The one front end of the command-line tools (pretrain/run.py, downstream/finetune.py,
linear_probe.py, knn.py): their arguments, the config they load from them, and the run
directory they open. The CLIs stay a page each: parse -> config -> model -> plan -> engine."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import BaseModel

from mpp.config import Config, ConfigError, load_config, save_config


def run_parser(doc: str, configs: str, resume: bool = True) -> argparse.ArgumentParser:
    """--config, --set, --output-dir, the launcher's --local_rank, and for training runs --resume."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help=f"a JSON file, or a name in configs/ ({configs})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key, value as JSON")
    p.add_argument("--output-dir", help="the run directory (default: the config's output_dir)")
    if resume:
        p.add_argument("--resume", help="'auto' (newest complete checkpoint of this run) or a checkpoint path")
    p.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)  # the launcher's
    return p


def _output_key(cls: type[BaseModel]) -> str:
    return "train.output_dir" if "train" in cls.model_fields else "output_dir"


def config_from_args(args: argparse.Namespace, cls: type[BaseModel] = Config):
    """The validated config with --set and --output-dir applied. ConfigError (naming the key
    and the file) on a bad config, and on a --resume path that does not exist."""
    overrides = args.set + ([f"{_output_key(cls)}={args.output_dir}"] if args.output_dir else [])
    cfg = load_config(args.config, overrides, cls=cls)
    resume = getattr(args, "resume", None)
    if resume not in (None, "auto") and not Path(resume).exists():
        raise ConfigError(f"--resume {resume}: no such checkpoint")
    return cfg


def open_run_dir(cfg, rank: int) -> Path:
    """The run directory, created by rank 0, held by this job (``mpp.runlock``: RunHeld, a
    ConfigError, on every rank when another live job holds it) and the resolved config saved in
    it. A collective under a process group."""
    from mpp.distributed import from_rank0
    from mpp.runlock import RunHeld, hold

    template = cfg.train.output_dir if hasattr(cfg, "train") else cfg.output_dir
    run_dir = Path(template.format(name=cfg.name))
    held = None
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            hold(run_dir)
            save_config(cfg, run_dir / "config.json")
        except RunHeld as e:
            held = str(e)
    if held := from_rank0(held):
        raise RunHeld(held)
    return run_dir
