"""A CLI run as a job through submitit (``--submit slurm|local``; ``local``, submitit's local
executor, is what the tests use): one task per GPU, logs in ``RUN/submitit/``, and requeue on
preemption with no wrapper script (docs/ARCHITECTURE.md §5.3): after every rank's stop path
(``mpp.train.preemption``), rank 0 hands SIGUSR2 to submitit's handler, which requeues this
command with ``--resume auto``."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from mpp.cli import add_submit_arguments
from mpp.parallel.launch import DIST_VARS
from mpp.train.plan import run_dir_of
from mpp.train.preemption import PREEMPTED_EXIT, StopRequest

# --submit local without --time: the local executor needs some limit
LOCAL_TIME_LIMIT_MIN = 7 * 24 * 60
# how many times a job may reach its time limit and requeue (submitit's default, 3, would end a
# 300-hour run in 72-hour jobs after four of them); preemptions before the limit do not count
MAX_TIMEOUTS = 100


class SubmitError(Exception):
    """A --submit flag that cannot work (said in one line, exit status 2)."""


class RunFailed(RuntimeError):
    """The CLI run inside the job ended with a non-zero status (the job fails with it)."""

    def __init__(self, script: str, status: int) -> None:
        super().__init__(f"{Path(script).name} exited with status {status}")
        self.status = status


def split_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the submission flags, ``argv`` without them: the command each task runs). The same flags
    as the CLI's parser (``add_submit_arguments``), so the same abbreviations."""
    parser = argparse.ArgumentParser(add_help=False)
    add_submit_arguments(parser)
    return parser.parse_known_args(argv)


def with_resume_auto(argv: list[str], keep_given: bool = False) -> list[str]:
    """``argv`` resuming from this run's newest complete checkpoint: any --resume replaced, or
    with ``keep_given`` a given one kept."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--resume")
    given, rest = parser.parse_known_args(argv)
    return list(argv) if keep_given and given.resume else [*rest, "--resume", "auto"]


def timeout_minutes(text: str) -> int:
    """SLURM's --time formats (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in whole minutes."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise SubmitError(f"--time {text}: expected [D-]HH:MM:SS or minutes, as SLURM's --time")
    days, a, b, c = m.groups()
    if days is not None:  # D-H[:M[:S]]
        hours, minutes, seconds = a, b or 0, c or 0
    elif c is not None:  # H:M:S
        hours, minutes, seconds = a, b, c
    else:  # M or M:S
        hours, minutes, seconds = 0, a, b or 0
    total_s = ((int(days or 0) * 24 + int(hours)) * 60 + int(minutes)) * 60 + int(seconds)
    if total_s <= 0:
        raise SubmitError(f"--time {text}: the limit must be positive")
    return math.ceil(total_s / 60)


def sbatch_options(pairs: list[str]) -> dict[str, Any]:
    """--slurm-arg KEY=VALUE (or a bare KEY: a flag) as submitit's additional sbatch parameters.
    Keys are submitit's (underscores), so ``cpus-per-task`` replaces its default rather than
    adding a second ``#SBATCH`` line."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not key.strip("-"):
            raise SubmitError(
                f"--slurm-arg {pair}: expected KEY=VALUE (an sbatch option without its --)"
            )
        options[key.strip("-").replace("-", "_")] = value if sep else True
    return options


def make_executor(
    sub: argparse.Namespace,
    folder: Path,
    name: str,
    tasks_per_node: int | None = None,
    sbatch_extra: dict[str, str] | None = None,
) -> Any:
    """submitit's executor for ``sub.submit``: ``nodes`` x ``gpus_per_node`` tasks, one per GPU
    (or ``tasks_per_node`` tasks sharing them); ``sbatch_extra`` adds sbatch options (a dependency)."""
    if sub.nodes < 1 or sub.gpus_per_node < 1:
        raise SubmitError(
            f"--nodes {sub.nodes} --gpus-per-node {sub.gpus_per_node}: one task per GPU, at least one"
        )
    if sub.submit == "slurm" and not sub.time:
        raise SubmitError("--submit slurm needs --time: submitit's default limit is 5 minutes")
    if sub.submit == "local" and sub.nodes > 1:
        raise SubmitError(
            f"--submit local --nodes {sub.nodes}: the local executor runs on this machine only"
        )
    try:  # an optional extra: imported only when a job is submitted
        import submitit
    except ImportError:
        raise SubmitError("--submit needs submitit: pip install 'mpp[slurm]'") from None
    executor = submitit.AutoExecutor(
        folder=folder,
        cluster=sub.submit,
        slurm_max_num_timeout=MAX_TIMEOUTS,
        local_max_num_timeout=MAX_TIMEOUTS,
    )
    executor.update_parameters(
        name=name,
        nodes=sub.nodes,
        tasks_per_node=tasks_per_node or sub.gpus_per_node,
        gpus_per_node=sub.gpus_per_node,
        timeout_min=timeout_minutes(sub.time) if sub.time else LOCAL_TIME_LIMIT_MIN,
        slurm_partition=sub.partition,
        slurm_additional_parameters={**sbatch_options(sub.slurm_arg), **(sbatch_extra or {})}
        or None,
    )
    return executor


def submit(command: str, argv: list[str] | None, cfg: Any, resumable: bool = True) -> int:
    """Submit the run of ``command`` (a module with ``main``, ``mpp.commands.pretrain``; ``argv``
    less the submission flags) for the validated ``cfg``:
    the job id and its log folder, and 0; with --wait, the job's exit status once it has ended.
    A run that is not ``resumable`` (the probes: minutes, no checkpoints) restarts when requeued."""
    sub, rest = split_argv(sys.argv[1:] if argv is None else argv)
    run_dir = run_dir_of(cfg).resolve()
    # --resume auto from the first start: a restart SLURM makes on its own (a node lost, a
    # preemption's SIGTERM under PreemptMode=REQUEUE) continues too, rather than from step 0
    argv = with_resume_auto(rest, keep_given=True) if resumable else rest
    run = SubmittedRun(command, argv, resumable)
    try:
        job = make_executor(sub, run_dir / "submitit", cfg.name).submit(run)
    except (SubmitError, RuntimeError) as e:
        return refused(e, sub.submit)
    logs = f"{run_dir}/submitit/{job.job_id}_*"
    shape = f"{sub.nodes} node(s) x {sub.gpus_per_node} task(s)"
    print(
        f"submitted job {job.job_id} ({sub.submit}, {shape}) -> {run_dir}; logs: {logs}", flush=True
    )
    if not sub.wait:
        return 0
    try:
        status = wait_for(job)
    except KeyboardInterrupt:
        print(f"stopped waiting for job {job.job_id}", file=sys.stderr)
        return 130
    print(f"job {job.job_id} ended: exit status {status}; logs: {logs}", flush=True)
    return status


def refused(error: Exception, how: str) -> int:
    """A submission that did not happen, in one line: exit status 2 for a flag that cannot work
    (SubmitError), 1 for submitit's RuntimeError (no srun here, or sbatch refused the job: its
    own words above)."""
    if isinstance(error, SubmitError):
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"error: --submit {how}: {str(error).strip() or type(error).__name__}", file=sys.stderr)
    return 1


def wait_for(job: Any) -> int:
    """The job's exit status once it has ended, requeues included: rank 0's run's (1 when the
    job ended without saying, e.g. killed)."""
    from submitit.core.utils import FailedJobError, UncompletedJobError

    job.wait()
    try:
        job.task(0).result()
        return 0
    except FailedJobError:  # the status rank 0's run wrote (SubmittedRun), else 1
        status = status_file(job.paths.folder, job.job_id)
        return int(status.read_text()) if status.is_file() else 1
    except UncompletedJobError:
        return 1


def status_file(folder: Path, job_id: str) -> Path:
    """Where rank 0 of a job leaves its run's exit status when it is not 0 (a job that ends
    without writing it, e.g. killed, reads as 1)."""
    return Path(folder) / f"{job_id}_status"


class SubmittedRun:
    """What every task of the job runs: the CLI's ``main(argv)`` in-process, in the job's
    process group. submitit's Checkpointable protocol: ``checkpoint()`` is the requeued job."""

    def __init__(self, command: str, argv: list[str], resumable: bool = True) -> None:
        self.script, self.argv, self.resumable = command, list(argv), resumable

    def __call__(self) -> int:
        join_job_process_group()
        main = importlib.import_module(self.script).main  # mpp.commands.*: in any install
        status = main(list(self.argv))
        if status == PREEMPTED_EXIT:
            self._requeue_if_asked()
        if status != 0:  # the job fails (SLURM's FAILED; --wait returns this status)
            from submitit import JobEnvironment

            env = JobEnvironment()
            if env.global_rank == 0:
                status_file(env.paths.folder, env.job_id).write_text(f"{status}\n")
            raise RunFailed(self.script, status)
        return status

    def checkpoint(self) -> Any:
        """The job to requeue: this command, resuming from this run's newest complete checkpoint
        (a run that is not resumable: from its start)."""
        from submitit.helpers import DelayedSubmission

        argv = with_resume_auto(self.argv) if self.resumable else self.argv
        return DelayedSubmission(SubmittedRun(self.script, argv, self.resumable))

    def _requeue_if_asked(self) -> None:
        """After a stop on the job's preemption signal: rank 0 calls submitit's handler for it
        (``checkpoint_and_try_requeue``: ``self.checkpoint()``, the pickle, the requeue, then
        exit), the others exit 0 (SLURM's ``scontrol requeue`` ends them anyway; a non-zero
        status could end rank 0 before it requeues where ``KillOnBadExit`` is set). A stop on
        another signal (scancel's SIGTERM, Ctrl-C) is not requeued: the job fails with 75."""
        from submitit import JobEnvironment

        usr_sig = JobEnvironment._usr_sig()  # USR2, or SUBMITIT_PREEMPT_SIGNAL
        if StopRequest.last_agreed != usr_sig:
            return
        if int(os.environ["RANK"]) != 0:
            sys.exit(0)
        handler = signal.getsignal(usr_sig)  # the training loop's handler is restored by now
        if callable(handler):
            handler(usr_sig, None)  # requeues and exits (or raises: timed out too many times)


def join_job_process_group() -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT from the job (SLURM's or the local
    executor's) for mpp.parallel.distributed.init_distributed, none of the submitting shell's. Every rank
    sees the node's GPUs and takes cuda:LOCAL_RANK, as under the deepspeed launcher."""
    from submitit.helpers import TorchDistributedEnvironment

    # a MASTER_PORT inherited by the local executor would be taken as the job's
    for var in DIST_VARS:
        os.environ.pop(var, None)
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
