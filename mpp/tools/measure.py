"""Timing and tables that the doctor, the planner and the suites in benchmarks/ share
(docs/ARCHITECTURE.md §6)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_times(
    fns: dict[str, Callable[[], Any]],
    rounds: int,
    warmup: int = 1,
    device: torch.device | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each fn, ``rounds`` times each, after ``warmup`` untimed calls.

    Rounds are interleaved (a, b, c, a, b, c, ...): on a shared machine a burst of load
    then hits every contender alike, so ratios within one run stay sound; take medians.
    """
    device = device or torch.device("cpu")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def _cell(v: Any, fmt: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, str) or not fmt:
        return str(v)
    return format(v, fmt)


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table: ``columns`` are (key, header, format spec)."""
    header = [h for _, h, _ in columns]
    body = [[_cell(r.get(k), f) for k, _, f in columns] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(b) for b in body)])
