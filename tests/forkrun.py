"""The tests' commands, forked from a warm interpreter instead of started cold.

A rank or a CLI of the suite spends 3-8 s of CPU importing torch, DeepSpeed and what DeepSpeed
pulls in at ``deepspeed.initialize`` (torch._dynamo through torch.optim, torch._inductor through
its Muon check), then about a second on its tiny job; the suite starts some 300 of them.
``run(args, ...)`` runs ``python SCRIPT ...``, ``python -m MODULE ...`` and DeepSpeed's per-node
launcher (``conftest.launcher``) in processes forked from multiprocessing's forkserver, which has
imported all that once: the same script, arguments, environment, working directory, stdin from
/dev/null, stdout and stderr captured, exit status (a launch's is the launcher's: the first
failing rank's, the others terminated). What only a fresh interpreter shows stays a subprocess:
``conftest.run_cli(..., fresh=True)``, the runner (``deepspeed``), whatever ``run`` does not
parse (it returns None), and everything on a machine with a GPU (no fork after CUDA). What the
forked ones do not show: one hash seed for every process (a fresh one draws its own), and the
ranks' parent is the server, not DeepSpeed's launcher (so ``job_lineage`` finds no launcher to
watch); the tests of launches through the ``deepspeed`` runner keep both.
"""

from __future__ import annotations

import atexit
import base64
import ctypes
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import psutil
import torch

PRELOAD = [
    "torch",
    "deepspeed",
    "torch._dynamo",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "mpp.jobs",
    "mpp.commands.pretrain",
    "mpp.commands.finetune",
    "mpp.commands.knn",
    "mpp.commands.probe",
    "forkrun",
]
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(PRELOAD)
LAUNCHER = "deepspeed.launcher.launch"
# what the preloaded imports put in the environment, as they do in a fresh process (deepspeed)
SET_AT_IMPORT = ("PYTORCH_NVML_BASED_CUDA_CHECK",)


def start() -> None:
    """The server, started now (it imports while the tests begin) with this environment."""
    if not torch.cuda.is_available():
        multiprocessing.forkserver.ensure_running()


def _child(argv: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    """In the forked process: become ``python *argv`` and exit with its status."""
    multiprocessing.set_start_method(None, force=True)  # a fresh one's: the data workers fork
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    os.chdir(cwd)
    set_at_import = {k: os.environ[k] for k in SET_AT_IMPORT if k in os.environ}
    os.environ.clear()
    os.environ.update({**set_at_import, **env})
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if env.get("OMP_NUM_THREADS"):  # read by the OpenMP runtime when torch loaded: set it here
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path[:0] = [cwd, *extra]
            if not hasattr(sys.modules.get(argv[1]), "__path__"):  # a package runs __main__
                sys.modules.pop(argv[1], None)  # preloaded: run as __main__, as python -m does
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            script = Path(cwd, argv[0]).resolve()
            sys.path[:0] = [str(script.parent), *extra]
            runpy.run_path(str(script), run_name="__main__")  # __file__ absolute, as python's
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  what the interpreter prints for an uncaught error
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110  a closed stream: nothing left to write
                pass
        ctypes.CDLL(None).fflush(None)  # C's stdio too: os._exit skips it
        os._exit(code & 0xFF)


def _parse(args: list[str]) -> tuple[list[str], int, list[str]] | None:
    """(python's arguments from the script or -m on, ranks, the launcher's rank environment) or
    None."""
    if not args or Path(args[0]).name not in ("python", "python3") and args[0] != sys.executable:
        return None
    rest = list(args[1:])
    while rest and rest[0] == "-u":  # the interpreter's, not the script's
        rest.pop(0)
    if not rest or (rest[0].startswith("-") and rest[0] != "-m") or rest == ["-m"]:
        return None
    if rest[:2] != ["-m", LAUNCHER]:
        return rest, 1, []
    flags, rest = {}, rest[2:]
    while rest and rest[0].startswith("--"):
        key, sep, value = rest.pop(0)[2:].partition("=")
        if key not in ("world_info", "master_addr", "master_port", "log_level") or not (
            sep or rest
        ):
            return None
        flags[key] = value if sep else rest.pop(0)
    if not rest or rest[0].startswith("-") or not {"world_info", "master_port"} <= set(flags):
        return None
    world = json.loads(base64.urlsafe_b64decode(flags["world_info"]))
    if len(world) != 1:
        return None
    ids = next(iter(world.values()))
    env = [f"MASTER_ADDR={flags.get('master_addr', '127.0.0.1')}"]
    env += [f"MASTER_PORT={flags['master_port']}", f"WORLD_SIZE={len(ids)}", "CROSS_RANK=0"]
    env += ["CROSS_SIZE=1", f"LOCAL_SIZE={len(ids)}"]
    env += [f"CUDA_VISIBLE_DEVICES={','.join(map(str, ids))}"]
    return rest, len(ids), env


def run(
    args: list, cwd: Path, env: dict, timeout: float | None
) -> subprocess.CompletedProcess | None:
    """``subprocess.run(args, capture_output=True, text=True)`` in forked processes, or None
    where ``args`` is not a python command or launch this can run, or a GPU is present."""
    parsed = None if torch.cuda.is_available() else _parse([os.fspath(a) for a in args])
    if parsed is None:
        return None
    argv, ranks, world = parsed
    deadline = None if timeout is None else time.monotonic() + timeout
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        out.touch()
        err.touch()
        procs = []
        try:
            for rank in range(ranks):
                rank_env, rank_argv = dict(env), list(argv)
                if world:
                    rank_env.update(v.split("=", 1) for v in world)
                    rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank))
                    at = 2 if argv[0] == "-m" else 1
                    rank_argv[at:at] = [f"--local_rank={rank}"]
                p = _CTX.Process(target=_child, args=(rank_argv, rank_env, str(cwd), out, err))
                p.start()
                procs.append(p)
            code = _wait(procs, deadline)
        except BaseException:
            _stop(procs, kill=True)
            raise
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if code is None:
        raise subprocess.TimeoutExpired(args, timeout, stdout, stderr)
    if code < 0 and world:  # the launcher's sys.exit(-N)
        code &= 0xFF
    return subprocess.CompletedProcess(args, code, stdout, stderr)


def _wait(procs: list, deadline: float | None) -> int | None:
    """DeepSpeed's launcher's rule: 0 when every rank exits 0; at the first that does not, the
    others' process trees are terminated and that status is the launch's. None at the deadline
    (every tree killed)."""
    alive = list(procs)
    while alive:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            _stop(procs, kill=True)
            return None
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=left)
        for p in [p for p in alive if p.exitcode is not None]:
            alive.remove(p)
            if p.exitcode != 0:
                _stop(alive, kill=False)
                return p.exitcode
    return 0


def _stop(procs: list, kill: bool) -> None:
    """launch.py's ``terminate_process_tree`` for each (SIGTERM, SIGKILL after 30 s), or SIGKILL
    at once."""
    tree = []
    for p in procs:
        if p.exitcode is None:
            try:
                root = psutil.Process(p.pid)
                tree += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
    for q in tree:
        try:
            q.kill() if kill else q.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=30)
    for q in alive:
        q.kill()
    for p in procs:
        p.join()
