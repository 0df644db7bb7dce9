"""mpp plot RUN [--out FILE.png]: a run's curves from its metrics.jsonl, by default RUN/curves.png.
Loss and lr at every optimiser step, the monitor's k-NN and masked loss, a fine-tune's validation
top-1; a dashed line where the run was resumed.
A run writes the same picture when it ends (with matplotlib installed: pip install 'mpp[plot]')."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from mpp.train.metrics import read_records

log = logging.getLogger(__name__)

# (title, the records' key): one panel each, where the run logged it
PANELS = [
    ("training loss", "loss"),
    ("learning rate", "lr"),
    ("monitor: k-NN top-1 (%)", "monitor/knn_top1"),
    ("monitor: masked loss", "monitor/masked_loss"),
    ("validation top-1 (%)", "val_top1"),
]


# an interval record's every optimiser step (metrics.jsonl, log_every > 1), the last at its step
PER_STEP = {"loss": "step_losses", "lr": "step_lrs"}


def series(run_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Each panel's (steps, values) from the run's records, loss and lr at every optimiser step
    (``PER_STEP``), the last record of a step kept."""
    records = read_records(run_dir, kind="all")
    out = {}
    for title, key in PANELS:
        points = {}
        for r in records:
            if isinstance(r.get(key), (int, float)):
                points.update(every_step(r, key))
        if points:
            steps = sorted(points)
            out[title] = (steps, [points[s] for s in steps])
    return out


def every_step(record: dict, key: str) -> dict[int, float]:
    """{step: value} of ``key`` in one record: each step of its interval where it holds them."""
    per_step = record.get(PER_STEP.get(key, ""))
    if isinstance(per_step, list) and per_step:
        first = record["step"] - len(per_step) + 1
        return {first + i: v for i, v in enumerate(per_step)}
    return {record["step"]: record[key]}


def resumes(run_dir: Path) -> list[int]:
    """The steps the run was resumed at (a record's ``resumed_at``: the first after a resume)."""
    records = read_records(run_dir, kind="all")
    return sorted({r["resumed_at"] for r in records if isinstance(r.get("resumed_at"), int)})


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """RUN/curves.png (or ``out``); ImportError without matplotlib, ValueError with no records."""
    # a Figure of its own, no pyplot: a notebook's backend and open figures are left alone
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    curves = series(run_dir)
    if not curves:
        raise ValueError(f"{run_dir}: no metrics.jsonl records to draw")
    fig = Figure(figsize=(3.6 * len(curves), 3.0))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(curves), squeeze=False)
    resumed = resumes(run_dir)
    for ax, (title, (steps, values)) in zip(axes[0], curves.items(), strict=True):
        ax.plot(steps, values, marker="." if len(steps) < 30 else None)
        for i, step in enumerate(resumed):  # where a command went on from a checkpoint
            label = "resumed" if i == 0 else None
            ax.axvline(step, color="grey", linestyle="--", linewidth=0.8, label=label)
        if resumed:
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(run_dir.name, fontsize=10)
    fig.tight_layout()
    path = Path(out) if out else run_dir / "curves.png"
    fig.savefig(path, dpi=100)
    return path


def curves_at_end(run_dir: Path) -> str:
    """The picture a run draws when it ends: its path, or why there is none (one line)."""
    try:
        return str(plot_run(run_dir))
    except ImportError:
        return "no curves.png (pip install 'mpp[plot]' for matplotlib)"
    except Exception as e:  # noqa: BLE001  a picture never fails the run it describes
        return f"no curves.png ({type(e).__name__}: {e})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mpp plot", description=__doc__.splitlines()[0])
    p.add_argument("run", help="a run directory (its metrics.jsonl)")
    p.add_argument("--out", help="the PNG to write (default RUN/curves.png)")
    args = p.parse_args(argv)
    try:
        print(f"wrote {plot_run(args.run, args.out)}")
    except ImportError:
        print("error: mpp plot needs matplotlib: pip install 'mpp[plot]'", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
