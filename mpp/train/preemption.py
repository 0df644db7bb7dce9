"""Stopping a run cleanly when the cluster asks (SLURM sends SIGUSR1 ahead of time with
``#SBATCH --signal=USR1@120``, SIGTERM at the end; DeepSpeed's launcher forwards SIGTERM; a job
submitted through submitit gets SIGUSR2, ``--signal=USR2@90``: mpp.submit), when a terminal
closes (SIGHUP) or on Ctrl-C (SIGINT; a second one interrupts at once).

A signal only sets a flag; at every optimiser step the ranks agree on it (one all-reduce of
one CPU number, on a gloo group so it never waits for the GPU), so they all stop after the
same step, write one complete checkpoint and exit with ``PREEMPTED_EXIT``. The same command
then continues exactly (a run directory with a checkpoint resumes by default: ``mpp.cli``).

A signal sent to the ``deepspeed`` runner alone (a container's PID 1, ``kill``, a CI timeout, a
notebook's stop button) kills the runner and reaches no rank: DeepSpeed forwards nothing on one
node, and its launcher and ranks went on to the end of the run as orphans. So each rank watches
its job's process tree: when its launcher, or the runner above a DeepSpeed launcher, is gone, it
sets the flag as SIGHUP would ("the job lost its controlling process").
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from mpp.train.hooks import Hook

log = logging.getLogger(__name__)

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: try again (a requeue wrapper tests for it)
# SIGUSR2 is submitit's preemption/timeout signal (its sbatch asks SLURM for --signal=USR2@90, and
# its local executor sends it the same way): without it here, submitit's own handler would requeue
# the job mid-step with no checkpoint. Here it takes the same path; mpp.submit then requeues.
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT)
WATCH_EVERY_S = 1.0


class Preempted(Exception):
    """The run stopped on a signal after a complete checkpoint at ``step``."""

    def __init__(self, step: int, signum: int, reason: str | None = None) -> None:
        why = f"{signal.Signals(signum).name} ({reason})" if reason else signal.Signals(signum).name
        super().__init__(
            f"preempted by {why} after step {step}: a complete checkpoint is saved; the same "
            f"command (without --restart) goes on from it"
        )
        self.step, self.signum = step, signum


class StopRequest:
    """Installs the handlers (every rank, before the data workers start: they inherit them and
    only set their own copy of the flag, so they keep serving until the rank stops)."""

    # the signal this process's last stop was agreed on: mpp.submit requeues on its own only
    last_agreed = 0

    def __init__(self) -> None:
        self.signum, self.reason, self.interrupted = 0, None, False
        self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        self.group, self.device = control_group()
        self.done = threading.Event()
        if lineage := job_lineage():
            threading.Thread(
                target=self._watch, args=(lineage,), daemon=True, name="mpp-job-watch"
            ).start()

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self.interrupted:
                raise KeyboardInterrupt  # Ctrl-C twice: now, without the checkpoint
            self.interrupted = True
        # the first one is the cause: on Ctrl-C DeepSpeed's launcher follows the terminal's
        # SIGINT with a SIGTERM of its own
        self.signum = self.signum or signum

    def _watch(self, lineage: list[tuple[int, int, str]]) -> None:
        while not self.done.wait(WATCH_EVERY_S):
            if lost := lost_parent(lineage):
                self.reason = self.reason or lost
                self.signum = self.signum or signal.SIGHUP
                return

    def agreed(self) -> int:
        """The signal any rank got (0: none), the same on every rank. A collective: every rank calls it."""
        flag = torch.tensor([self.signum], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            # once, at the stop; the watchers tick apart: rank 0's may not have seen it yet
            if flag.item():
                reasons = [None] * dist.get_world_size()
                dist.all_gather_object(reasons, self.reason, group=self.group)
                self.reason = next((r for r in reasons if r), None)
        if signum := int(flag.item()):
            StopRequest.last_agreed = signum
        return signum

    def restore(self) -> None:
        self.done.set()
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def control_group() -> tuple[Any, torch.device]:
    """(group, device) the stop flag is agreed on. Under NCCL a side gloo group with a CPU number:
    the default group needs a GPU tensor, and reading it back syncs the step. Gloo across nodes
    fails ("connectFullMesh failed") where a hostname resolves to loopback (Debian's 127.0.1.1)
    and GLOO_SOCKET_IFNAME is unset: then, decided by every rank together, the default group."""
    cpu = torch.device("cpu")
    if not dist.is_initialized() or dist.get_backend() == "gloo":
        return None, cpu
    gpu = torch.device("cuda", torch.cuda.current_device())
    ok = torch.tensor([int(gloo_reachable())], device=gpu)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # once, at start: every rank takes the same path
    if ok.item():
        return dist.new_group(backend="gloo"), cpu
    if dist.get_rank() == 0:
        log.warning(
            "a node's hostname resolves to a loopback address and GLOO_SOCKET_IFNAME is unset: the "
            "stop flag goes over NCCL (one host sync per optimiser step); set GLOO_SOCKET_IFNAME to "
            "the nodes' network interface (e.g. eth0, ib0) to avoid it"
        )
    return None, gpu


def gloo_reachable() -> bool:
    """Whether gloo can connect this rank to the others: always on one node (loopback serves),
    across nodes when told the interface or when the hostname resolves off loopback."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    # torchrun's, DeepSpeed's
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    if os.environ.get("GLOO_SOCKET_IFNAME") or (local and int(local) >= world):
        return True
    try:
        return not socket.gethostbyname(socket.gethostname()).startswith("127.")
    except OSError:
        return False


def job_lineage() -> list[tuple[int, int, str]]:
    """[(pid, the parent it must keep, what that parent is)] for this rank's job to be whole: this
    rank under its launcher, and a DeepSpeed launcher under the runner (or, across nodes, pdsh's
    shell) that started it. Empty outside a known launcher: a plain ``python`` run's parent is a
    shell that may well exit (``nohup``) while the run goes on."""
    me, launcher = os.getpid(), os.getppid()
    try:
        parent = psutil.Process(launcher)
        command = " ".join(parent.cmdline())
        if "deepspeed.launcher.launch" in command:
            return [
                (me, launcher, "its launcher"),
                (launcher, parent.ppid(), "the deepspeed runner"),
            ]
        if "torch.distributed.run" in command or "torchrun" in command:
            return [(me, launcher, "its launcher")]
    except psutil.Error:
        pass
    return []


def lost_parent(lineage: list[tuple[int, int, str]]) -> str | None:
    """Which link of ``lineage`` broke ("the deepspeed runner (pid N) ended"), or None. A process
    whose parent exits is given another one at once, zombie or not: the parent pid tells."""
    for pid, parent, what in lineage:
        try:
            now = os.getppid() if pid == os.getpid() else psutil.Process(pid).ppid()
        except psutil.Error:
            now = None
        if now != parent:
            return f"{what} (pid {parent}) ended"
    return None


def write_marker(run_dir: Path, step: int, signum: int, reason: str | None = None) -> None:
    """``RUN/preempted.json`` on rank 0: what stopped the run and where (a requeue script reads it)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        record = {
            "step": step,
            "signal": signal.Signals(signum).name,
            "exit_status": PREEMPTED_EXIT,
        }
        if reason:
            record["reason"] = reason
        (run_dir / "preempted.json").write_text(json.dumps(record) + "\n")


class StopHook(Hook):
    """A stop signal as a ``mpp.train.hooks.Hook``: the handlers installed when the loop starts
    (before the loader's workers fork at its first batch: they inherit them) and restored when it
    ends; after each optimiser step's checkpoint, when any rank got a signal, one checkpoint here
    (unless just written), ``preempted.json`` and ``Preempted``."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.request = run_dir, None

    def start(self, trainer: Any) -> None:
        self.request = StopRequest()

    def saved(self, trainer: Any, saved: bool) -> None:
        if signum := self.request.agreed():
            if not saved:
                trainer.checkpointer.save(trainer.state)
            step = trainer.state.step
            write_marker(self.run_dir, step, signum, self.request.reason)
            raise Preempted(step, signum, self.request.reason)

    def close(self) -> None:
        if self.request is not None:
            self.request.restore()
