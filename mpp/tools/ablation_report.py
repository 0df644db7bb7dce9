"""The masking ablation's report (``mpp.tools.ablation`` runs the grid): results.csv, results.md
(mean ± std over seeds per cell and evaluation) and results.png (top-1 per cell, error bars),
drawn with matplotlib (the ``plot`` extra)."""

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
    ]
    body = [
        [BASELINES[name][0], *(entry(*stats.get((name, e), (0.0, 0.0, 0))) for e in evals)]
        for name in dict.fromkeys(r["baseline"] for r in rows)
    ]
    return lines + markdown_table(["baseline", *evals], body)


def markdown_table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(cells) + " |" for cells in [header, *body]]
    return [lines[0], "|" + "---|" * len(header), *lines[1:]]


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
    about: list[str] = (),
) -> None:
    """The tables; ``about`` (``provenance``) and ``shared`` (the spec's ``set``) under the title."""
    baselines = [r for r in rows if r.get("baseline")]
    rows = [r for r in rows if not r.get("baseline")]
    cells = list(dict.fromkeys(tuple(r[k] for k in keys) for r in rows))
    lines = [f"# {title}", ""]
    if about:
        lines += [*about, ""]
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
        body = [[*cell, *(entry(*stats[(*cell, kind)]) for kind in columns)] for cell in cells]
        lines += ["", heading, "", *markdown_table([*keys, *columns], body)]
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


def plot(
    rows: list[dict],
    keys: list[str],
    evals: list[str],
    path: Path,
    group_key: str = "masking.strategy",
) -> None:
    """Top-1 per cell as bars with ± std error bars: one panel per evaluation, bars grouped by
    ``group_key`` (the strategy; else the first grid key) and coloured by the others; the
    baselines as dashed lines. Needs matplotlib (the ``plot`` extra)."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from mpp.tools.ablation import BASELINES

    scratch = summarize([r for r in rows if r.get("baseline")], ["baseline"], "top1")
    rows = [r for r in rows if not r.get("baseline")]
    gkey = group_key if group_key in keys else (keys[0] if keys else None)
    others = [k for k in keys if k != gkey]
    stats = summarize(rows, keys, "top1")
    groups = list(dict.fromkeys(r[gkey] for r in rows)) if gkey else ["base"]
    series = list(dict.fromkeys(tuple(r[k] for k in others) for r in rows))
    width = 0.8 / max(1, len(series))
    fig = Figure(figsize=(max(4.6, 1.2 + len(groups) * len(series) * 0.35), 2.8 * len(evals) + 0.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(evals), 1, squeeze=False)[:, 0]
    for ax, kind in zip(axes, evals, strict=True):
        for j, s in enumerate(series):
            label = ", ".join(f"{k}={v}" for k, v in zip(others, s, strict=True)) or "mean top-1"
            for gi, g in enumerate(groups):
                cell = tuple(g if k == gkey else s[others.index(k)] for k in keys)
                mean, std, n = stats[(*cell, kind)]
                x = gi + (j - (len(series) - 1) / 2) * width
                if not n:
                    ax.text(x, 0, "failed", color="red", ha="center", va="bottom", fontsize=8)
                    continue
                colour = colormaps["tab10"](j % 10)
                ax.bar(x, mean, width * 0.9, color=colour, label=label if gi == 0 else None)
                ax.errorbar(x, mean, yerr=std, color="black", capsize=4, linewidth=2)
        for (name, k), (mean, _, n) in scratch.items():
            if k == kind and n:
                ax.axhline(mean, color="0.35", linestyle="--", label=BASELINES[name][0])
        ax.set_title(kind, fontsize=10, loc="left")
        ax.set_xticks(range(len(groups)), [str(g) for g in groups])
        ax.set_xlabel(gkey or "")
        ax.set_ylabel("top-1 (%)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, title="± std over seeds (n finished)", title_fontsize=8)
    fig.suptitle("top-1 (%) per cell, mean ± std over seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


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
    write_markdown(rows, keys, spec.evaluations, paths[1], title, spec.set, provenance(elapsed_s))
    copies = [(paths[1], spec.publish_markdown)]
    try:
        plot(rows, keys, spec.evaluations, paths[2])
        copies.append((paths[2], spec.publish_plot))
    except ImportError:  # the tables are the result; the chart needs the plot extra
        print("results.png: pip install 'mpp[plot]' to draw it", flush=True)
        paths.pop()
    for source, target in copies:
        if target:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
            paths.append(Path(target))
    return paths
