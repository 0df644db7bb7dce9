"""The masking ablation's report (``mpp.tools.ablation`` runs the grid): results.csv, results.md
(mean ± std over seeds per cell and evaluation) and results.png (top-1 per cell, error bars),
drawn with PIL alone."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpp.tools.ablation import AblationSpec


def write_csv(rows: list[dict], keys: list[str], path: Path) -> None:
    """A row per cell, seed and evaluation; a baseline's row has its name under ``baseline``."""
    with open(path, "w", newline="") as f:
        fields = [*keys, "baseline", "seed", "eval", "top1", "top5", "max_top1", "status", "path"]
        w = csv.DictWriter(f, fields, restval="")
        w.writeheader()
        w.writerows(rows)


def baseline_lines(rows: list[dict], title: str) -> list[str]:
    """The fine-tuning-from-scratch table: mean ± std (n) per baseline, each labelled."""
    from mpp.tools.ablation import BASELINES

    if not rows:
        return []
    stats = summarize(rows, ["baseline"], "top1")
    evals = list(dict.fromkeys(r["eval"] for r in rows))
    lines = [
        "",
        f"## {title}: fine-tuning from scratch (top-1 %)",
        "",
        "The fair comparison is **own schedule** (its config's longer recipe); **same schedule** "
        "uses the pretrained cells' fine-tuning recipe, which under-trains scratch and overstates "
        "pretraining's gain.",
        "",
        "| baseline | " + " | ".join(evals) + " |",
        "|---|" + "---|" * len(evals),
    ]
    for name in dict.fromkeys(r["baseline"] for r in rows):
        lines.append(
            f"| {BASELINES[name][0]} | "
            + " | ".join(entry(*stats.get((name, e), (0.0, 0.0, 0))) for e in evals)
            + " |"
        )
    return lines


def entry(mean: float, std: float, n: int) -> str:
    return f"{mean:.2f} ± {std:.2f} ({n})" if n else "failed (0)"


def summarize(
    rows: list[dict], keys: list[str], metric: str
) -> dict[tuple, tuple[float, float, int]]:
    """(cell values..., eval) -> (mean, sample std over seeds (0 for one), seeds that finished)."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        values = groups.setdefault((*[r[k] for k in keys], r["eval"]), [])
        if r["status"] == "ok" and r.get(metric) not in (None, ""):
            values.append(float(r[metric]))
    return {
        g: (
            statistics.fmean(v) if v else float("nan"),
            statistics.stdev(v) if len(v) > 1 else 0.0,
            len(v),
        )
        for g, v in groups.items()
    }


def write_markdown(
    rows: list[dict],
    keys: list[str],
    evals: list[str],
    path: Path,
    title: str,
    shared: list[str] = (),
) -> None:
    """The tables; ``shared`` (the spec's ``set``) is listed under the title."""
    baselines = [r for r in rows if r.get("baseline")]
    rows = [r for r in rows if not r.get("baseline")]
    cells = list(dict.fromkeys(tuple(r[k] for k in keys) for r in rows))
    lines = [f"# {title}", ""]
    if shared:
        lines += ["Every cell: " + ", ".join(f"`{s}`" for s in shared), ""]
    lines += [
        "mean ± std (n) over seeds; std is the sample standard deviation, n the seeds that finished."
    ]
    fine_tunes = [e for e in evals if e.split("@")[0] == "finetune"]
    tables = [
        ("top1", evals, "## top1 (%)"),
        ("top5", evals, "## top5 (%)"),
        (
            "max_top1",
            fine_tunes,
            "## fine-tuning's best epoch on the validation set (MAE's \"max\"; an extra column, "
            "not the result: the tables above report the last evaluation)",
        ),
    ]
    for metric, columns, heading in tables:
        if not columns:
            continue
        stats = summarize(rows, keys, metric)
        lines += [
            "",
            heading,
            "",
            "| " + " | ".join([*keys, *columns]) + " |",
            "|" + "---|" * (len(keys) + len(columns)),
        ]
        for cell in cells:
            entries = [entry(*stats[(*cell, kind)]) for kind in columns]
            lines.append("| " + " | ".join([*cell, *entries]) + " |")
        if metric == "top1":
            lines += baseline_lines(baselines, "Baselines")
    failed = [r for r in [*rows, *baselines] if r["status"] != "ok"]
    if failed:
        lines += ["", "## Failed or not finished", ""]
        where = lambda r: r.get("baseline") or ", ".join(r[k] for k in keys) or "base"  # noqa: E731
        lines += [
            f"- {where(r)}, seed {r['seed']}, {r['eval']}: {r['status']} `{r['path']}`"
            for r in failed
        ]
    path.write_text("\n".join(lines) + "\n")


PALETTE = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
]


def plot(
    rows: list[dict],
    keys: list[str],
    evals: list[str],
    path: Path,
    group_key: str = "masking.strategy",
) -> None:
    """Top-1 per cell as bars with ± std error bars (PIL only): one panel per evaluation, bars
    grouped by ``group_key`` (the strategy; else the first grid key) and coloured by the others."""
    from PIL import Image, ImageDraw, ImageFont

    from mpp.tools.ablation import BASELINES

    scratch = summarize([r for r in rows if r.get("baseline")], ["baseline"], "top1")
    rows = [r for r in rows if not r.get("baseline")]
    font, small = ImageFont.load_default(size=15), ImageFont.load_default(size=12)
    gkey = group_key if group_key in keys else (keys[0] if keys else None)
    others = [k for k in keys if k != gkey]
    stats = summarize(rows, keys, "top1")
    groups = list(dict.fromkeys(r[gkey] for r in rows)) if gkey else ["base"]
    series = list(dict.fromkeys(tuple(r[k] for k in others) for r in rows))
    cell_of = lambda g, s: tuple(g if k == gkey else s[others.index(k)] for k in keys)  # noqa: E731
    bar, left, plot_h, panel_h = 26, 80, 200, 275
    width = max(460, left + len(groups) * max(len(series) * bar + 30, 90) + 20)
    group_w = (width - left - 20) / len(groups)
    labels = [
        ", ".join(f"{k}={v}" for k, v in zip(others, s, strict=True)) or "mean top-1"
        for s in series
    ]
    labels.append("± std over seeds (n finished)")
    per_row = max(1, (width - left) // 200)
    legend_h = 24 * -(-len(labels) // per_row) + 12
    img = Image.new("RGB", (width, 40 + legend_h + panel_h * len(evals)), "white")
    d = ImageDraw.Draw(img)
    d.text((left, 10), "top-1 (%) per cell, mean ± std over seeds", fill="black", font=font)
    legend(d, labels, len(series), left, per_row, small)
    ylabel = Image.new("RGB", (plot_h, 16), "white")
    ImageDraw.Draw(ylabel).text(
        (plot_h // 2, 0), "top-1 (%)", fill="black", font=small, anchor="ma"
    )
    ylabel = ylabel.rotate(90, expand=True)
    for p, kind in enumerate(evals):
        y0 = 40 + legend_h + p * panel_h + 24  # top of this panel's plot area
        found = [
            m + sd for (*_, k), (m, sd, n) in [*stats.items(), *scratch.items()] if k == kind and n
        ]
        ymax = max(10.0, -(-max(found, default=10.0) // 10) * 10)
        y_of = lambda v, y0=y0, ymax=ymax: y0 + plot_h - min(v, ymax) / ymax * plot_h  # noqa: E731
        d.text((left, y0 - 22), kind, fill="black", font=font)
        for t in range(0, int(ymax) + 1, 10 if ymax <= 50 else 20):
            d.line([left, y_of(t), width - 20, y_of(t)], fill=(225, 225, 225))
            d.text((left - 8, y_of(t)), f"{t}", fill="black", font=small, anchor="rm")
        img.paste(ylabel, (14, y0))
        d.line([left, y0, left, y0 + plot_h, width - 20, y0 + plot_h], fill="black")
        for gi, g in enumerate(groups):
            gx = left + gi * group_w + (group_w - len(series) * bar) / 2
            for j, s in enumerate(series):
                mean, std, n = stats[(*cell_of(g, s), kind)]
                x, cx = gx + j * bar, gx + j * bar + bar / 2
                if not n:
                    d.text(
                        (cx, y0 + plot_h - 4), "failed", fill=(200, 0, 0), font=small, anchor="mb"
                    )
                    continue
                d.rectangle(
                    [x + 2, y_of(mean), x + bar - 2, y0 + plot_h], fill=PALETTE[j % len(PALETTE)]
                )
                lo, hi = y_of(max(0.0, mean - std)), y_of(mean + std)
                for line in ([cx, lo, cx, hi], [cx - 5, lo, cx + 5, lo], [cx - 5, hi, cx + 5, hi]):
                    d.line(line, fill="black", width=2)
            d.text(
                (left + (gi + 0.5) * group_w, y0 + plot_h + 6),
                str(g),
                fill="black",
                font=small,
                anchor="mt",
            )
        d.text(
            ((left + width) / 2, y0 + plot_h + 24),
            gkey or "",
            fill="black",
            font=small,
            anchor="mt",
        )
        # the baselines: dashed lines
        for j, ((name, k), (mean, _, n)) in enumerate(scratch.items()):
            if k == kind and n:
                dashed_line(
                    d, left, width - 20, y_of(mean), BASELINES[name][0], small, below=j % 2 == 1
                )
    img.save(path)


def legend(d, labels: list[str], n_series: int, left: int, per_row: int, font) -> None:
    """A colour per setting of the other grid keys, then the error bar's sign."""
    for j, label in enumerate(labels):
        x, y = left + (j % per_row) * 200, 38 + 24 * (j // per_row)
        if j < n_series:
            d.rectangle([x, y, x + 14, y + 14], fill=PALETTE[j % len(PALETTE)])
        else:
            d.line([x + 7, y, x + 7, y + 14], fill="black", width=2)
            d.line([x + 2, y, x + 12, y], fill="black", width=2)
            d.line([x + 2, y + 14, x + 12, y + 14], fill="black", width=2)
        d.text((x + 20, y), label, fill="black", font=font)


def dashed_line(d, x0: float, x1: float, y: float, label: str, font, below: bool = False) -> None:
    """A grey dashed line at height ``y``, its label right-aligned above it (or below)."""
    for x in range(int(x0), int(x1), 12):
        d.line([x, y, min(x + 6, x1), y], fill=(90, 90, 90), width=2)
    d.text(
        (x1 - 2, y + 3 if below else y - 2),
        label,
        fill=(90, 90, 90),
        font=font,
        anchor="rt" if below else "rb",
    )


def provenance(elapsed_s: float | None = None) -> list[str]:
    """What made the numbers: the command, the commit, the machine, the date (and wall time)."""
    import datetime
    import os
    import platform
    import shlex
    import subprocess
    import sys

    import torch

    from mpp.parallel.launch import REPO

    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
            return out.stdout.strip() if out.returncode == 0 else ""
        except OSError:
            return ""

    commit = git("rev-parse", "--short=12", "HEAD") or "unknown (not a git checkout)"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " with uncommitted changes"
    cpu = platform.processor() or platform.machine()
    try:
        names = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    import deepspeed

    machine = (
        f"{cpu}, {os.cpu_count()} cores, {gpu}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__}"
    )
    command = shlex.join([Path(sys.argv[0]).name if sys.argv[0] else "python", *sys.argv[1:]])
    lines = [
        f"- command: `{command}`",
        f"- commit: `{commit}`",
        f"- machine: {machine}",
        f"- finished: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
    ]
    if elapsed_s is not None:
        lines.append(f"- wall time: {elapsed_s / 60:.0f} min")
    return lines


def write_report(
    spec: AblationSpec, rows: list[dict], elapsed_s: float | None = None
) -> list[Path]:
    """results.csv / .md / .png in the output folder, and the spec's ``publish`` copies (the
    markdown with where the numbers came from; the plot)."""
    import shutil

    keys, out = list(spec.grid), spec.out_dir
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.csv", out / "results.md", out / "results.png"]
    write_csv(rows, keys, paths[0])
    title = spec.title or f"Ablation of {Path(spec.base).name}"
    write_markdown(rows, keys, spec.evaluations, paths[1], title, spec.set)
    text = paths[1].read_text()
    head, _, rest = text.partition("\n\n")
    paths[1].write_text(f"{head}\n\n" + "\n".join(provenance(elapsed_s)) + f"\n\n{rest}")
    plot(rows, keys, spec.evaluations, paths[2])
    for source, target in ((paths[1], spec.publish_markdown), (paths[2], spec.publish_plot)):
        if target:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
            paths.append(Path(target))
    return paths
