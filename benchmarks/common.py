"""What every suite shares: the machine's description, timing, the matmul roofline, tables, JSON."""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import median  # noqa: F401  (the suites take it from here)
from typing import Any

import torch

from mpp.tools.measure import format_table, interleaved_times, sync  # noqa: F401  (the suites take them from here)

ROOT = Path(__file__).resolve().parents[1]


def clone_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the clone's root on PYTHONPATH: the launcher's ranks run ``python -m
    benchmarks.X`` from wherever the suite was started."""
    return {
        **env,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
    }


class Unavailable(RuntimeError):
    """A suite cannot run on this machine (e.g. gpu-step without a GPU): exit 2 with the message."""


def cpu_model() -> str:
    """``lscpu``'s model name, or the platform's processor string where lscpu is missing."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def machine_info(argv: list[str] | None = None) -> dict[str, Any]:
    """Date (UTC), machine, load and software: what a figure needs to be compared with another."""
    argv = sys.argv[1:] if argv is None else argv
    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": "python -m benchmarks " + shlex.join(argv),
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        # the machine is shared: the load at measuring time says how much to trust a figure
        "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


@contextmanager
def num_threads(n: int | None) -> Iterator[int]:
    """Run with ``n`` intra-op threads (None: torch's default, the core count), then restore.

    The quick forms use 1: on a shared 2-core machine their tiny matmuls gain nothing from a
    second thread, and a busy core makes the two threads wait on each other (measured: a
    20 ms step taking 2 s under load)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def peak_rss_bytes() -> int:
    """This process's RSS high-water mark: VmHWM of /proc/self/status. Not getrusage's
    ru_maxrss: Linux carries that across fork + exec, so a child started by a big parent
    reports the parent's RSS as its own floor (measured: 300 MiB for a 15 MiB point)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def current_rss_bytes() -> int:
    """This process's resident set size now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def matmul_roofline(
    n: int, device: torch.device, dtype: torch.dtype = torch.float32, k: int = 5
) -> tuple[Callable[[], None], list[float], int]:
    """The machine's own roofline: a closure that times ``k`` back-to-back n x n x n matmuls and
    appends the fastest to the returned list (seconds), and the FLOPs of one (2 n^3).

    Fastest of k, because a 0.1 s matmul is what a burst of load hits hardest: a single one
    per round made the median roofline 30 % low and the step ratios above 1."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    best: list[float] = []

    def fn() -> None:
        times = []
        for _ in range(k):
            sync(device)
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            sync(device)
            times.append(time.perf_counter() - start)
        best.append(min(times))

    return fn, best, 2 * n**3


# ---- output ------------------------------------------------------------------------------------


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def demo_step(name: str, quick: bool) -> tuple[Any, Any, int, int, Callable[[], None]]:
    """A shipped config's objective and one training step of it (forward, backward, Adam) on
    random images at its micro-batch (8 with ``quick``): (cfg, objective, img size, batch, step).
    What the preview and monitor suites time their calls against."""
    from mpp.build import build_objective
    from mpp.config import load_config
    from mpp.train.optim import build_optimizer

    cfg = load_config(name)
    objective = build_objective(cfg)
    size = objective.encoder.patch_embed.img_size[0]
    batch = 8 if quick else cfg.micro_batch(1)[0]
    images = torch.randn(batch, 3, size, size)
    optimizer = build_optimizer(cfg, objective)

    def step() -> None:
        loss, _ = objective(images)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return cfg, objective, size, batch, step
