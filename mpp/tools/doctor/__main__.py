"""mpp doctor [--out DIR] [--quick] [--config NAME]      (or python -m mpp.tools.doctor ...)

Checks this machine for a pretraining run and says what it found: the environment, attention
kernels against the project's math backend, and a short real run through the deepspeed launcher.
Prints a verdict table and writes DIR/doctor.json. Exit status 1 when any row fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import platform
import sys
import textwrap
import time
from pathlib import Path

import torch

from mpp.tools.doctor import FAIL, VERDICTS, Row
from mpp.tools.measure import format_table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="mpp doctor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        default="runs/doctor",
        help="folder for doctor.json and the engine run (default runs/doctor)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer steps and timing rounds (what the test suite runs)",
    )
    p.add_argument(
        "--config",
        default="mae_b16",
        help="the shipped config the engine run trains (default mae_b16)",
    )
    return p.parse_args(argv)


def run_checks(out: Path, config: str, quick: bool) -> tuple[list[Row], dict[str, float]]:
    """Every section in order; each one's wall time."""
    from mpp.tools.doctor.engine_run import engine_rows
    from mpp.tools.doctor.environment import environment_rows
    from mpp.tools.doctor.parity import attention_rows

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sections = {
        "environment": environment_rows,
        "attention": lambda: attention_rows(device, quick),
        "engine": lambda: engine_rows(out, config, quick),
    }
    rows, seconds = [], {}
    for name, check in sections.items():
        start = time.perf_counter()
        rows += check()
        seconds[name] = round(time.perf_counter() - start, 1)
    return rows, seconds


# the table's width: a terminal's; each reason wraps onto lines of its own (one was 335 wide)
WIDTH = 100


def render(rows: list[Row], width: int = WIDTH) -> str:
    """The verdict table, at most ``width`` columns wide where no word is longer than its
    column, a long reason on several lines; then how many rows have each verdict."""
    keys = ("section", "check", "verdict")
    fixed = sum(max(len(k), *(len(getattr(r, k)) for r in rows)) for k in keys)
    room = max(width - fixed - 3 * len(keys) - 4, 20)  # "| " and " | " between, " |" at the end
    lines = []
    for r in rows:
        wrapped = textwrap.wrap(r.reason, room, break_long_words=False, break_on_hyphens=False)
        first, *more = wrapped or [""]
        lines.append({**{k: getattr(r, k) for k in keys}, "reason": first})
        lines += [{**dict.fromkeys(keys, ""), "reason": line} for line in more]
    columns = [(k, k, "") for k in (*keys, "reason")]
    counts = ", ".join(f"{sum(r.verdict == v for r in rows)} {v}" for v in VERDICTS)
    return format_table(lines, columns) + f"\n\n{counts}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    out = Path(args.out).resolve()  # its runs start in this directory, whatever the cwd
    out.mkdir(parents=True, exist_ok=True)
    rows, seconds = run_checks(out, args.config, args.quick)
    report = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": "python -m mpp.tools.doctor " + " ".join(sys.argv[1:] if argv is None else argv),
        "host": platform.node(),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else "cpu (no CUDA device)",
        "quick": args.quick,
        "config": args.config,
        "section_seconds": seconds,
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    (out / "doctor.json").write_text(json.dumps(report, indent=1) + "\n")
    print(render(rows))
    print(f"-> {out / 'doctor.json'}")
    return 1 if any(r.verdict == FAIL for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
