"""Top-1 per block (``--layers all``): a Markdown table (printed, and results.md) and a bar chart
(per_block.png, drawn with PIL alone: the project has no matplotlib)."""

from __future__ import annotations

from pathlib import Path


def per_block_table(rows: list[dict], title: str) -> str:
    """``rows``: [{"block", "top1", "top5"}, ...] -> a Markdown section."""
    lines = [f"# {title}", "", "| block | top-1 (%) | top-5 (%) |", "|---|---|---|"]
    lines += [f"| {r['block']} | {r['top1']:.2f} | {r['top5']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def plot_per_block(rows: list[dict], title: str, path: Path) -> None:
    """One bar per block, its top-1 written above it; the y axis from 0 to the next 10 % above the best."""
    from PIL import Image, ImageDraw, ImageFont

    font, small = ImageFont.load_default(size=15), ImageFont.load_default(size=12)
    left, top, plot_h, bar = 60, 56, 220, max(18, min(48, 480 // max(1, len(rows))))
    title_w = ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(title, font=font)
    width = max(left + len(rows) * (bar + 8) + 30, int(title_w) + 30, 360)
    img = Image.new("RGB", (width, top + plot_h + 50), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 10), title, fill="black", font=font)
    ymax = max(10.0, -(-max(r["top1"] for r in rows) // 10) * 10)
    y_of = lambda v: top + plot_h - min(v, ymax) / ymax * plot_h  # noqa: E731
    for t in range(0, int(ymax) + 1, 10 if ymax <= 50 else 20):
        d.line([left, y_of(t), img.width - 20, y_of(t)], fill=(225, 225, 225))
        d.text((left - 8, y_of(t)), f"{t}", fill="black", font=small, anchor="rm")
    d.line([left, top, left, top + plot_h, img.width - 20, top + plot_h], fill="black")
    for i, r in enumerate(rows):
        x = left + 8 + i * (bar + 8)
        d.rectangle([x, y_of(r["top1"]), x + bar, top + plot_h], fill=(31, 119, 180))
        d.text(
            (x + bar / 2, y_of(r["top1"]) - 2),
            f"{r['top1']:.1f}",
            fill="black",
            font=small,
            anchor="mb",
        )
        d.text(
            (x + bar / 2, top + plot_h + 6), str(r["block"]), fill="black", font=small, anchor="mt"
        )
    d.text(
        ((left + img.width) / 2, top + plot_h + 26),
        "block (0 = first)",
        fill="black",
        font=small,
        anchor="mt",
    )
    d.text((8, top - 18), "top-1 (%)", fill="black", font=small)
    img.save(path)


def write_per_block(run_dir: Path, rows: list[dict], title: str) -> str:
    """results.md and per_block.png in ``run_dir``; the table, to print."""
    table = per_block_table(rows, title)
    (run_dir / "results.md").write_text(table)
    plot_per_block(rows, title, run_dir / "per_block.png")
    return table
