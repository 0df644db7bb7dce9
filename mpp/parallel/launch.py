"""Starting our own CLIs as child jobs (the demo, the ablation runner): the DeepSpeed launcher
command, a clean environment, a log per job (docs/ARCHITECTURE.md §5.3)."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# a child job forms its own process group: none of the caller's may leak in
DIST_VARS = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env() -> dict[str, str]:
    """This interpreter's bin first on PATH (its ``deepspeed``, and its ninja should DeepSpeed
    JIT-build an op: two ninja versions sharing the build cache rebuild it each time they
    alternate), and no distributed variables of the caller."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", PYTHONUNBUFFERED="1"
    )
    return env


def default_launcher_args() -> list[str]:
    """One rank per GPU; on a machine without one, 2 CPU ranks (gloo)."""
    import torch

    return ["--num_gpus", str(torch.cuda.device_count() if torch.cuda.is_available() else 2)]


def deepspeed_cmd(launcher_args: list[str], module: str, args: list[str]) -> list[str]:
    """``deepspeed [launcher args] --master_port <free> --module MODULE args`` (a given port is
    kept): the rank runs ``python -m MODULE`` (``mpp.commands.pretrain``), so an installed wheel
    launches it as a clone does."""
    given = any(a.startswith("--master_port") for a in launcher_args)
    port = [] if given else ["--master_port", str(free_port())]
    return ["deepspeed", *launcher_args, *port, "--module", module, *args]


def launch(cmd: list[str], log: Path) -> int:
    """Run one job in this directory, its output appended to ``log``; the exit status."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        try:
            proc = subprocess.Popen(cmd, env=job_env(), stdout=f, stderr=subprocess.STDOUT)
        except OSError as e:  # e.g. no deepspeed on PATH: this job fails, the caller decides
            f.write(f"error: {e}\n")
            return 127
        return _wait_for_tree(proc)


def _wait_for_tree(proc: subprocess.Popen) -> int:
    """The job's exit status, once its processes are all gone: a stop signal to the whole job
    (SLURM's) kills the ``deepspeed`` launcher at once while its ranks still write their
    checkpoint; the caller must not go on (or exit) before they are done."""
    import psutil

    tree: list = []
    while True:
        try:
            return_code = proc.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            try:
                tree = psutil.Process(proc.pid).children(recursive=True) or tree
            except psutil.Error:
                pass
    psutil.wait_procs(tree, timeout=600)
    return return_code
