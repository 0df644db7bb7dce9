"""The one front end of the command-line tools (pretrain/run.py, downstream/finetune.py,
linear_probe.py, knn.py): their arguments, the config they load from them, and the run
directory they open. The CLIs stay a page each: parse -> config -> model -> plan -> engine."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from mpp.config import Config, ConfigError, load_config, save_config
from mpp.hub.encoder_file import MODEL_FILE
from mpp.quiet import add_verbose_argument


def add_set_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key, value as JSON",
    )


def run_parser(
    doc: str, configs: str, resume: bool = True, submit: bool = False
) -> argparse.ArgumentParser:
    """--config, --set, --output-dir, --verbose (``mpp.quiet``), the launcher's --local_rank, for
    training runs --resume, and with ``submit`` the job flags (``add_submit_arguments``) of a CLI
    that hands them to mpp.submit."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config", required=True, help=f"a JSON file, or a name in configs/ ({configs})"
    )
    add_set_argument(p)
    p.add_argument("--output-dir", help="the run directory (default: the config's output_dir)")
    add_verbose_argument(p)
    if resume:
        g = p.add_mutually_exclusive_group()
        g.add_argument(
            "--resume",
            help="'auto' (newest complete checkpoint of this run) or a checkpoint path; "
            "by default a run directory that holds a complete checkpoint goes on from it",
        )
        g.add_argument(
            "--restart",
            action="store_true",
            help="start over in the run directory: what an earlier run left there is moved "
            "aside to RUN.before-<time>, not deleted",
        )
    p.add_argument(
        "--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS
    )  # the launcher's
    if submit:
        add_submit_arguments(p)
    return p


def add_submit_arguments(p: argparse.ArgumentParser) -> None:
    """--submit and the job's shape: run this command as a SLURM job (or through submitit's local
    executor) that requeues itself on preemption (mpp.submit)."""
    g = p.add_argument_group("submitting as a job (submitit: pip install 'mpp[slurm]')")
    g.add_argument(
        "--submit",
        choices=("slurm", "local"),
        help="run as a job on SLURM, or through submitit's local executor on this machine",
    )
    g.add_argument("--nodes", type=int, default=1, help="nodes of the job (default 1)")
    g.add_argument(
        "--gpus-per-node",
        type=int,
        default=1,
        help="GPUs per node, one task (rank) each (default 1)",
    )
    g.add_argument("--partition", help="the SLURM partition")
    g.add_argument(
        "--time",
        help="the job's time limit, [D-]HH:MM:SS or minutes (required with --submit slurm)",
    )
    g.add_argument(
        "--slurm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other sbatch option, e.g. cpus-per-task=10, account=A, constraint=volta32gb",
    )
    g.add_argument(
        "--wait", action="store_true", help="return when the job has ended, with its exit status"
    )


def config_from_args(args: argparse.Namespace, cls: type[BaseModel] = Config):
    """The validated config with --set and --output-dir applied. ConfigError (naming the key
    and the file) on a bad config, and on --restart with --submit."""
    key = "train.output_dir" if "train" in cls.model_fields else "output_dir"
    overrides = args.set + ([f"{key}={args.output_dir}"] if args.output_dir else [])
    cfg = load_config(args.config, overrides, cls=cls)
    if getattr(args, "restart", False) and getattr(args, "submit", None):
        # a job's requeue runs its command again: it would start over each time
        raise ConfigError(
            "--restart with --submit: a requeued job would start over again; name a new "
            "--output-dir (or move the run directory aside) instead"
        )
    return cfg


def keep_earlier_config(cfg, path: Path, restart: str = "") -> None:
    """The same run directory run again with another config goes on under the new one: the keys
    that changed said on stderr (``restart``: how to start over instead), the earlier config
    kept beside as ``config.<UTC time>.json``."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    now = json.loads(json.dumps(cfg.model_dump(mode="json")))
    changed = [
        f"{key} {before!r} -> {after!r}"
        for key, before, after in _differences(earlier, now)
        if key.rsplit(".", 1)[-1] != "output_dir"
    ]
    if not changed:
        return
    kept = aside(path.with_name(f"config.{_stamp()}.json"), ".json")
    path.replace(kept)
    shown = "; ".join(changed[:8]) + (f"; and {len(changed) - 8} more" if len(changed) > 8 else "")
    print(
        f"warning: {path.parent} was started with another config: {shown} (the earlier one kept "
        f"as {kept.name}{restart})",
        file=sys.stderr,
    )


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def aside(path: Path, suffix: str = "") -> Path:
    """``path`` (its name ending in ``suffix``), or with this process's id before the suffix when
    that is taken (two in one second)."""
    if not path.exists():
        return path
    return path.with_name(f"{path.name.removesuffix(suffix)}-{os.getpid()}{suffix}")


def _differences(a: Any, b: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) wherever two JSON trees differ (None where absent)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys()):
            yield from _differences(a.get(key), b.get(key), f"{prefix}{key}.")
    elif a != b:
        yield prefix.rstrip("."), a, b


def open_run_dir(
    cfg, rank: int, restart: bool = False, pixels=None, model=None, restartable: bool = True
) -> Path:
    """The run directory, created by rank 0, held by this job (``mpp.train.runlock``: RunHeld, a
    ConfigError, on every rank when another live job holds it) and the config as loaded saved in
    it; beside it what the run found: with ``pixels``, the statistics it uses (data.json), with
    ``model``, the encoder it built (model.json). With ``restart`` what an earlier run left there
    moved aside first (``RUN.before-<UTC time>``); ``restartable``: the command has --restart
    (``keep_earlier_config`` says so). A collective under a process group."""
    from mpp.parallel.distributed import from_rank0
    from mpp.train.plan import run_dir_of
    from mpp.train.runlock import RunHeld, hold, release

    run_dir = run_dir_of(cfg)
    held = None
    if rank == 0:
        try:
            if restart and run_dir.is_dir() and any(run_dir.iterdir()):
                hold(run_dir)  # not from under a live job
                moved = aside(run_dir.with_name(f"{run_dir.name}.before-{_stamp()}"))
                release(run_dir)
                run_dir.rename(moved)
                print(f"--restart: the earlier run moved to {moved}", file=sys.stderr)
            run_dir.mkdir(parents=True, exist_ok=True)
            hold(run_dir)
            again = "; --restart starts over" if restartable else ""
            keep_earlier_config(cfg, run_dir / "config.json", again)
            save_config(cfg, run_dir / "config.json")
            if pixels is not None:  # the statistics used (mpp.data.stats.Pixels): data.json
                pixels.save(run_dir)
            if model is not None:
                (run_dir / MODEL_FILE).write_text(json.dumps(model, indent=2) + "\n")
        except RunHeld as e:
            held = str(e)
        except OSError as e:  # a directory that cannot be moved or made: said on every rank
            held = f"{run_dir}: {e.strerror or e}"
    if held := from_rank0(held):
        raise RunHeld(held)
    return run_dir
