"""What ``mpp pretrain``, ``mpp finetune`` and the probes share once parsed (``job_main``), down
to how a job's command ends: the exit status that the launchers, ``mpp.submit`` and a requeue
wrapper read."""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch.distributed as dist

from mpp.checkpoint.storage import CheckpointError, DiskFullError
from mpp.cli import config_from_args
from mpp.config import ConfigError
from mpp.data import DataError
from mpp.jobs import going_on, initial_model, start_of
from mpp.parallel.distributed import PortInUse, world_from_env
from mpp.submit import submit
from mpp.train.nonfinite import NonFiniteLossError
from mpp.train.preemption import PREEMPTED_EXIT, Preempted

# the one mapping from how a job stopped to its exit status (a subclass before its base)
EXIT_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (Preempted, PREEMPTED_EXIT),  # a complete checkpoint saved: the same command goes on
    (NonFiniteLossError, 1),
    (DataError, 1),
    (DiskFullError, 1),
    (CheckpointError, 2),  # nothing intact to resume from: the files are named
    (ConfigError, 2),  # RunHeld too: refused before anything was created
    (PortInUse, 2),
)


def train_main(args: Any, argv: list[str] | None, command: str, cls: type, run, report) -> int:
    """A training command once parsed (``job_main``): with --submit, what a submission checks
    before the job exists (its initial weights, ``mpp.jobs.initial_model``, and where it starts;
    not the data: the shards may be visible on the compute nodes only); else ``run(cfg, resume,
    restart)`` and rank 0's ``report`` of its ``mpp.jobs.Finished`` when it trained."""
    rank = world_from_env()[0]

    def check(cfg: Any) -> None:
        resume = start_of(cfg, args.resume, args.restart, rank, initial_model(cfg).encoder)
        going_on(cfg, args.resume, resume, rank)

    def ran(cfg: Any) -> Any:  # one that had finished: the line saying so is all
        done = run(cfg, args.resume, args.restart)
        return done if done.ran else None

    return job_main(args, argv, command, cls, check, ran, report)


def job_main(
    args: Any, argv: list[str] | None, command: str, cls: type, check, run, report, **submitted
) -> int:
    """Every job's command once parsed (pretrain, finetune, the probes): its config (``cls``);
    with --submit, ``check(cfg)``, then the job, whose every task runs ``command`` (a module,
    ``mpp.commands.pretrain``) without --submit (``submitted``: ``mpp.submit.submit``'s keywords);
    else ``run(cfg)`` here and rank 0's ``report`` of what it returns (None: nothing to report).

    0, or the exit status of how it stopped (``EXIT_STATUS``), said in one line: by rank 0
    where every rank stops alike (a stop signal, a refusal once the process group exists), else
    by each rank. An error that is not in the mapping propagates."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rank = world_from_env()[0]
    try:
        cfg = config_from_args(args, cls)
        if args.submit:  # checked here, run there
            check(cfg)
        else:
            done = run(cfg)
    except tuple(kind for kind, _ in EXIT_STATUS) as e:
        if isinstance(e, Preempted):
            line = f"stopped: {e}"
        else:  # DataLoader workers wrap the message in a traceback: its last line is the error
            text = str(e).strip()
            wrapped = isinstance(e, (NonFiniteLossError, DataError, DiskFullError))
            line = f"error: {text.splitlines()[-1] if wrapped else text}"
        alike = isinstance(e, Preempted) or (
            isinstance(e, (ConfigError, PortInUse)) and dist.is_initialized()
        )
        if rank == 0 or not alike:
            print(line, file=sys.stderr)
        return next(status for kind, status in EXIT_STATUS if isinstance(e, kind))
    if args.submit:
        return submit(command, argv, cfg, **submitted)
    if rank == 0 and done is not None:
        report(done)
    return 0


def probe_main(kind: str, argv: list[str] | None = None) -> int:
    """``mpp probe`` (``kind`` "linear") and ``mpp knn`` ("knn"): ``job_main`` with the probe's
    config, checks and run (``mpp.transfer.probe_cli``); a submitted job runs the kind's CLI."""
    from functools import partial

    from mpp.config import ProbeConfig
    from mpp.transfer.probe_cli import probe_parser, probe_setup, run_probe

    args = probe_parser(kind).parse_args(argv)
    args.set += [f"probe.{k}={v}" for k in ("protocol", "layers") if (v := getattr(args, k, None))]
    command = {"linear": "mpp.commands.probe", "knn": "mpp.commands.knn"}[kind]
    check = partial(probe_setup, kind=kind, submit=True)
    run = partial(run_probe, kind)
    return job_main(args, argv, command, ProbeConfig, check, run, print, resumable=False)


def own_part(done: Any) -> str:
    """What this command trained (``mpp.jobs.Finished.own``), for its done line: steps, images,
    its time, the median img/s of its own last records; after a resume, where it went on from
    and the run's step now (a resumed run's earlier parts are not this command's)."""
    from mpp.train.metrics import read_records

    own = done.own
    records = [r for r in read_records(done.run_dir) if r["step"] > own.first_step]
    recent = [r["imgs_per_sec"] for r in records[-5:]]
    rate = f", {sorted(recent)[len(recent) // 2]:.0f} img/s" if recent else ""
    minutes, secs = divmod(round(done.seconds), 60)
    line = f"{own.steps} steps, {own.images} images in {minutes}m{secs:02d}s{rate}"
    if own.first_step:
        line += f" (resumed at step {own.first_step}: the run is at step {own.step})"
    return line
