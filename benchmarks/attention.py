"""attention: forward + backward time and memory of the attention backends, N = 197 .. 4,096.

Memory is what grows with N. On CUDA it is the peak allocated during forward + backward
above the inputs (``torch.cuda.max_memory_allocated``). The CPU allocator keeps no peak
statistics, so on CPU the figure is the bytes the op keeps alive for backward, counted
exactly with ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages, inputs
included): the (B, H, N, N) probabilities for math, O(N) outputs and log-sum-exps for SDPA's
flash kernel. That is the memory a ViT holds per block until backward, so it decides whether
a long sequence fits, and it is deterministic. The full form cross-checks it with the RSS
high-water mark of one forward + backward in a fresh process per point, above the RSS
before it (it adds the transients: math's pre-softmax scores, the backward's N x N grads).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from benchmarks.common import (
    current_rss_bytes,
    format_table,
    interleaved_times,
    median,
    num_threads,
    peak_rss_bytes,
)
from mpp.models.attention import _xformers_ops, attention, resolve_backend

SETTINGS = {
    # ViT-S heads (6 x 64); 197 = ViT/16 at 224, 4,096 = a 64 x 64 patch grid
    "full": dict(
        tokens=[197, 576, 1024, 2048, 4096],
        batch=1,
        heads=6,
        head_dim=64,
        rounds=3,
        warmup=1,
        threads=None,
        rss=True,
    ),
    "quick": dict(
        tokens=[197, 394], batch=1, heads=6, head_dim=64, rounds=1, warmup=1, threads=1, rss=False
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def backends_for(device: torch.device) -> list[str]:
    """math and sdpa everywhere; xformers on CUDA when it imports."""
    names = ["math", "sdpa"]
    if device.type == "cuda" and _xformers_ops()[0] is not None:
        names.append("xformers")
    return names


def saved_bytes(fn: Callable[[], Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def cuda_peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes allocated during ``fn`` above what was allocated before it."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def rss_peak_bytes(backend: str, n: int, s: dict) -> int:
    """Run in a fresh process: RSS high-water mark of one fwd + bwd at N = ``n`` above the RSS
    just before it (after a small warm-up call has loaded kernels and thread pools)."""
    q, k, v, grad = _inputs(64, s, torch.device("cpu"), torch.float32)
    attention(q, k, v, backend).backward(grad)
    q, k, v, grad = _inputs(n, s, torch.device("cpu"), torch.float32)
    before = current_rss_bytes()
    attention(q, k, v, backend).backward(grad)
    return peak_rss_bytes() - before


def _rss_in_subprocess(backend: str, n: int, s: dict) -> int:
    code = (
        "import json, sys; from benchmarks.attention import rss_peak_bytes; "
        "print(rss_peak_bytes(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, backend, str(n), json.dumps(s)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(r.stdout.split()[-1])


def _inputs(n: int, s: dict, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, ...]:
    shape = (s["batch"], n, s["heads"], s["head_dim"])  # (B, N, H, hd), the backends' layout
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(shape, device=device, dtype=dtype)


def growth_exponent(ns: list[int], values: list[float]) -> float:
    """d log(value) / d log(N) between the two largest N: 1 = linear, 2 = quadratic."""
    return math.log(values[-1] / values[-2]) / math.log(ns[-1] / ns[-2])


def measure_tokens(
    n: int, s: dict, dev: torch.device, dtype: torch.dtype, backends: list[str]
) -> list[dict[str, Any]]:
    """Rows for N = ``n``: interleaved fwd + bwd timings, then each backend's memory."""
    q, k, v, grad = _inputs(n, s, dev, dtype)

    def fwd_bwd(b: str) -> Callable[[], None]:
        def f() -> None:
            attention(q, k, v, b).backward(grad)
            q.grad = k.grad = v.grad = None

        return f

    times = interleaved_times({b: fwd_bwd(b) for b in backends}, s["rounds"], s["warmup"], dev)
    rows = []
    for b in backends:
        if dev.type == "cuda":
            mem = cuda_peak_bytes(fwd_bwd(b), dev)
        else:
            mem = saved_bytes(lambda b=b: attention(q, k, v, b))
        rss = _rss_in_subprocess(b, n, s) / 2**20 if s["rss"] and dev.type == "cpu" else None
        rows.append(
            {
                "tokens": n,
                "backend": b,
                "ms": 1e3 * median(times[b]),
                "mem_mib": mem / 2**20,
                "rss_peak_mib": rss,
            }
        )
    return rows


def measure(s: dict, dev: torch.device) -> dict[str, Any]:
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    backends = backends_for(dev)
    default = resolve_backend("auto", dev)
    rows = [row for n in s["tokens"] for row in measure_tokens(n, s, dev, dtype, backends)]
    by = {b: [r for r in rows if r["backend"] == b] for b in backends}
    for r in rows:
        r["time_vs_math"] = r["ms"] / next(
            m["ms"] for m in by["math"] if m["tokens"] == r["tokens"]
        )
    ns = s["tokens"]
    exponents = {b: growth_exponent(ns, [r["mem_mib"] for r in by[b]]) for b in backends}
    rss_exponents = {
        b: growth_exponent(ns, [r["rss_peak_mib"] for r in by[b]])
        for b in backends
        if all(r["rss_peak_mib"] for r in by[b])
    }
    slowest = max(r["time_vs_math"] for r in by[default])
    return {
        "setting": {
            **s,
            "device": dev.type,
            "dtype": str(dtype).removeprefix("torch."),
            "memory": "cuda peak allocated" if dev.type == "cuda" else "saved-for-backward bytes",
        },
        "default_backend": default,
        "rows": rows,
        "memory_growth_exponent": exponents,
        "rss_growth_exponent": rss_exponents,
        "goal": {
            "default_memory_linear": exponents[default] <= 1.1,
            "default_never_slower_than_math": slowest <= 1.0,
            "default_worst_time_vs_math": slowest,
            "met": exponents[default] <= 1.1 and slowest <= 1.0,
        },
    }


def run(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    s = SETTINGS["quick" if quick else "full"]
    with num_threads(s["threads"]) as threads:
        result = measure(s, torch.device(device))
    result["setting"]["threads"] = threads
    return result


def render(result: dict[str, Any]) -> str:
    s = result["setting"]
    head = (
        f"B={s['batch']} H={s['heads']} hd={s['head_dim']} {s['dtype']} on {s['device']}, forward + backward; "
        f"memory = {s['memory']}; default backend: {result['default_backend']}"
    )
    table = format_table(
        result["rows"],
        [
            ("tokens", "N", "d"),
            ("backend", "backend", ""),
            ("ms", "ms", ".2f"),
            ("time_vs_math", "time ÷ math", ".2f"),
            ("mem_mib", "memory MiB", ".2f"),
            ("rss_peak_mib", "RSS peak MiB (fresh process)", ".1f"),
        ],
    )
    exps = ", ".join(f"{b} {e:.2f}" for b, e in result["memory_growth_exponent"].items())
    rss = ", ".join(f"{b} {e:.2f}" for b, e in result["rss_growth_exponent"].items())
    return (
        f"{head}\n{table}\nmemory growth exponent between the two largest N (1 linear, 2 quadratic): "
        f"{exps}" + (f"; of the RSS peak: {rss}" if rss else "")
    )
