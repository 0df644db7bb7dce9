"""Top-1 per block (``--layers all``): a Markdown table (printed, and results.md) and a bar chart
(per_block.png, drawn with matplotlib where the ``plot`` extra is installed)."""

from __future__ import annotations

from pathlib import Path


def per_block_table(rows: list[dict], title: str) -> str:
    """``rows``: [{"block", "top1", "top5"}, ...] -> a Markdown section."""
    lines = [f"# {title}", "", "| block | top-1 (%) | top-5 (%) |", "|---|---|---|"]
    lines += [f"| {r['block']} | {r['top1']:.2f} | {r['top5']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def plot_per_block(rows: list[dict], title: str, path: Path) -> None:
    """One bar per block, its top-1 written above it. Needs matplotlib (the ``plot`` extra)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(3.6, 0.9 + 0.45 * len(rows)), 3.2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    bars = ax.bar([str(r["block"]) for r in rows], [r["top1"] for r in rows], color="#1f77b4")
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xlabel("block (0 = first)")
    ax.set_ylabel("top-1 (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_per_block(run_dir: Path, rows: list[dict], title: str) -> str:
    """results.md and per_block.png in ``run_dir``; the table, to print."""
    table = per_block_table(rows, title)
    (run_dir / "results.md").write_text(table)
    try:
        plot_per_block(rows, title, run_dir / "per_block.png")
    except ImportError:  # the table is the result; the chart needs the plot extra
        table += "(per_block.png: pip install 'mpp[plot]' to draw it)\n"
    return table
